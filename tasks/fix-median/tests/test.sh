#!/bin/bash
# Imports /app/stats.py and compares median/mean/variance with the statistics module on many lists.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
