#!/bin/bash
# No index: the package's build backend (setuptools) is the image's own, hence --no-build-isolation.
pip install --no-index --no-build-isolation --root-user-action=ignore /app/textslug
