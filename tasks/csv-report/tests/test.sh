#!/bin/bash
# Runs /app/report.py on several generated CSV files and compares the JSON totals (and key order).
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
