#!/bin/bash
# Docker would run this as "worker"; furlong runs every command as the sandbox's root (docs/images.md,
# "The full builder: buildah"), so the check is on the files, not on who wrote them.
mkdir -p /logs/verifier
id worker >/dev/null && [ "$(cat /data/values.txt 2>/dev/null)" = "1,2,3" ]
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
