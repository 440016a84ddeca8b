#!/bin/bash
# The task's network is an allowlist of one host: it is reachable in both phases, any other host is not.
echo 0 > /logs/verifier/reward.txt
grep -q '^Origin: Debian' /app/Release || { echo "no /app/Release from Debian"; exit 0; }
curl -fsS -m 60 -o /dev/null http://deb.debian.org/debian/dists/bookworm/Release || { echo "allowed host refused"; exit 0; }
if curl -fsS -m 20 -o /dev/null https://pypi.org/simple/; then echo "pypi.org reachable, though not allowed"; exit 0; fi
echo 1 > /logs/verifier/reward.txt
