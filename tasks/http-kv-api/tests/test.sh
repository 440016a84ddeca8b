#!/bin/bash
# Exercises PUT/GET/DELETE on 127.0.0.1:8088 (overwrite, unicode, empty value, 404s) and checks statuses and bodies.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if python3 /tests/check.py; then
  echo 1 > /logs/verifier/reward.txt
fi
