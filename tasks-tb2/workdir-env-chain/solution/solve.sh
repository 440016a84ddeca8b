#!/bin/bash
# Relies on the image as Harbor gives it: commands start in the WORKDIR, with the image's PATH.
{ appinfo; cat seed.txt; } > ../report.txt
