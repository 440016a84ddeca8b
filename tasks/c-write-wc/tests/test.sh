#!/bin/bash
# Compiles /app/mywc.c and compares its 'lines words bytes' output with Python's count on varied inputs.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
