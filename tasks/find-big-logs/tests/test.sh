#!/bin/bash
# Compares /app/big_logs.txt with the expected sorted list of .log files larger than 1024 bytes.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
