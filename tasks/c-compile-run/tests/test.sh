#!/bin/bash
# Checks /app/primes is a working ELF binary and /app/primes_100.txt lists the primes below 100.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
