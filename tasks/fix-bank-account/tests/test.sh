#!/bin/bash
# Runs the pristine copy of test_bank.py (from /tests) against the agent's /app/bank.py.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /tests || exit 0
if PYTHONPATH=/app python3 -m unittest -v test_bank; then
  echo 1 > /logs/verifier/reward.txt
fi
