#!/bin/bash
# Plain bash checks: a debian image has no pytest, and this verifier needs none.
mkdir -p /logs/verifier
test "$(cat /app/total.txt 2>/dev/null)" = "10"
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
