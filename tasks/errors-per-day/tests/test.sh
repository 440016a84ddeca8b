#!/bin/bash
# Compares the 'DATE COUNT' lines of /app/errors_per_day.txt with the expected per-day ERROR counts.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
