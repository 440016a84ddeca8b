#!/bin/bash
# ssh reads ~/.ssh/config only when it is owned by the user running ssh (or root) and not writable by
# others ("Bad owner or permissions"): the verifier, root here as under Docker, must see it as its own.
echo 0 > /logs/verifier/reward.txt
conf=$(ssh -G backup) || exit 0
for want in "hostname 10.1.2.3" "port 2222" "user archiver" "identityfile /root/.ssh/backup_key"; do
  grep -qx "$want" <<<"$conf" || { echo "missing: $want"; exit 0; }
done
# ssh-keygen refuses a private key that others can read; -y derives the public key from it
derived=$(ssh-keygen -y -f /root/.ssh/backup_key | cut -d' ' -f1,2) || exit 0
[ "$derived" = "$(cut -d' ' -f1,2 /root/.ssh/backup_key.pub)" ] || { echo "public key mismatch"; exit 0; }
echo 1 > /logs/verifier/reward.txt
