#!/bin/bash
# Runs the agent's Makefile: vecdemo exists, make clean removes binary and objects, make rebuilds src/*.o and vecdemo.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
