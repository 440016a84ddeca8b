#!/bin/bash
# Checks rot13 was built and installed as /usr/local/bin/rot13: an ELF on PATH that rotates letters by 13.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
