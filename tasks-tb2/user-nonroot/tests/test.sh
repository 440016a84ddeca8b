#!/bin/bash
# The agent (and the oracle's solve.sh) ran as "worker", the image's USER; the tests run as root.
mkdir -p /logs/verifier
id worker >/dev/null && [ "$(cat /data/values.txt 2>/dev/null)" = "1,2,3" ] && [ "$(stat -c %U /data/values.txt)" = worker ]
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
