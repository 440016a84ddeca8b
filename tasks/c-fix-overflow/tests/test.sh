#!/bin/bash
# Runs /app/sumsq and a fresh build of /app/sumsq.c for several N up to 10^6 and compares with the formula.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
