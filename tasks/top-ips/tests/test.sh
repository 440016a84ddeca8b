#!/bin/bash
# Checks /app/top_ips.txt holds exactly the three expected 'COUNT IP' lines in order (spacing is free).
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
