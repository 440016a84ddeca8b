#!/bin/bash
# Compares /app/letter.txt with the expected filled-in letter; the inputs must be unchanged.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
