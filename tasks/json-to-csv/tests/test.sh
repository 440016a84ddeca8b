#!/bin/bash
# Parses /app/active_users.csv with the csv module and compares it with the active users sorted by id.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
