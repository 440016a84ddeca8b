#!/bin/bash
# Checks the local textslug package is installed: importable from /, its metadata present, its command on PATH.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
