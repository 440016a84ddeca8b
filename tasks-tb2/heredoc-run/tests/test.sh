#!/bin/bash
mkdir -p /logs/verifier
[ "$(ls /app/logs | wc -l)" = 3 ] && [ "$(cat /app/errors.txt 2>/dev/null)" = 4 ]
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
