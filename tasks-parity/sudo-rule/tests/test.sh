#!/bin/bash
# sudo ignores (and visudo rejects) a sudoers file that root does not own; `sudo -u` runs a command as
# another user. Both must work on what the agent wrote, as they do for root under Docker.
echo 0 > /logs/verifier/reward.txt
visudo -c -f /etc/sudoers.d/app || exit 0
rules=$(sudo -l -U app) || { echo "$rules"; exit 0; }
grep -q '(root) NOPASSWD: /usr/bin/id' <<<"$rules" || { echo "$rules"; exit 0; }
[ "$(grep -c NOPASSWD <<<"$rules")" = 1 ] || { echo "more than one rule: $rules"; exit 0; }
[ "$(sudo -u app id -un)" = app ] || exit 0
echo 1 > /logs/verifier/reward.txt
