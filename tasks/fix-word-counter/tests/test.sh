#!/bin/bash
# Runs /app/wordcount.py on many generated texts and compares with the specified top-N output.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
