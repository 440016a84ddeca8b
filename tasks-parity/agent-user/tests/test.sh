#!/bin/bash
# [agent] user = "app": the agent ran as app, so the file it wrote is app's.
echo 0 > /logs/verifier/reward.txt
[ "$(cat /tmp/whoami.txt 2>/dev/null)" = app ] || { echo "whoami.txt: $(cat /tmp/whoami.txt 2>&1)"; exit 0; }
[ "$(stat -c %U /tmp/whoami.txt)" = app ] || { echo "owner: $(stat -c %U /tmp/whoami.txt)"; exit 0; }
echo 1 > /logs/verifier/reward.txt
