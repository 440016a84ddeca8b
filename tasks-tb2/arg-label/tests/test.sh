#!/bin/bash
mkdir -p /logs/verifier
# the build argument's default reached the RUN step, and an ARG is not left in the runtime env
[ "$(cat /app/VERSION)" = 1.4.2 ] && [ -z "${APP_VERSION:-}" ] && [ "$(cat /app/NEXT_VERSION 2>/dev/null)" = 1.5.0 ]
rc=$?
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
