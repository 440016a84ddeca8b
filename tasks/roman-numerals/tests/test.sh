#!/bin/bash
# Runs the full test (every n in 1..3999 both ways, range and invalid-numeral errors) against /app/roman.py.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /tests || exit 0
if PYTHONPATH=/app python3 -m unittest test_roman_full; then
  echo 1 > /logs/verifier/reward.txt
fi
