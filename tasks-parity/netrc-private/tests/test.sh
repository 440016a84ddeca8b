#!/bin/bash
# Python's netrc module refuses a ~/.netrc holding a password that does not belong to the user reading it
# ("~/.netrc file owner ... does not match current user"), or that others can read.
echo 0 > /logs/verifier/reward.txt
[ "$(stat -c '%a %U' /root/.netrc)" = "600 root" ] || { stat -c '%a %U' /root/.netrc; exit 0; }
got=$(python3 -c 'import netrc; print(netrc.netrc().authenticators("files.example.com"))') || exit 0
[ "$got" = "('deploy', '', 's3cret')" ] || [ "$got" = "('deploy', None, 's3cret')" ] || { echo "got: $got"; exit 0; }
echo 1 > /logs/verifier/reward.txt
