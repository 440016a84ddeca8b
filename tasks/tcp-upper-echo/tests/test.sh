#!/bin/bash
# Connects two concurrent clients and a later one to 127.0.0.1:9009 and checks the upper-cased echo of each line.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
