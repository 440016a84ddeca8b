#!/bin/bash
# Fetches /index.html and /data/info.json from 127.0.0.1:8123 and compares them with the originals; /missing.html must 404.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
