#!/bin/bash
# Parses /app/app.ini with configparser: [server] port=9090 and debug=false, all else unchanged.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
