#!/bin/bash
# [agent] user = "app": the agent ran as app, so its file is app's, in app's home.
echo 0 > /logs/verifier/reward.txt
[ "$(cat /home/app/whoami.txt 2>/dev/null)" = app ] || { echo "whoami.txt: $(cat /home/app/whoami.txt 2>&1)"; exit 0; }
[ "$(stat -c %U /home/app/whoami.txt)" = app ] || { echo "owner: $(stat -c %U /home/app/whoami.txt)"; exit 0; }
echo 1 > /logs/verifier/reward.txt
