#!/bin/bash
# Checks /app/top_words.txt holds the five expected 'word count' lines in order.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
