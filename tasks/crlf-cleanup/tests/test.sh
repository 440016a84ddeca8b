#!/bin/bash
# Compares /app/notes.txt byte for byte with the cleaned expected file (LF, no trailing blanks).
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
