#!/bin/bash
mkdir -p /logs/verifier
python - <<'PY'
import importlib.metadata, pathlib, sys
assert importlib.metadata.version("wordstats") == "0.2.0", "the image's pip install is missing"
sys.exit(0 if pathlib.Path("/app/answer.txt").read_text() == "the\n" else 1)
PY
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
