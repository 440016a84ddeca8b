#!/bin/bash
# Runs /app/rle.py encode/decode on fixed and generated strings and checks exact one-line output.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
