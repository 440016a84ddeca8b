#!/bin/bash
# Checks /app/repo: v1.2.0 is an annotated tag "Version 1.2.0" on the "Release 1.2.0" commit and
# `latest` is a lightweight tag on main's tip (commit ids are fixed by setup_repo.sh).
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /app/repo || exit 0
fail() { echo "FAIL: $*"; exit 0; }
RELEASE=6880c194eb9e65a04a79f6dfba0cd996838e1cea
TIP=42e4e1c2db41f82fa3c8a050c970661dc7e449fe

[ "$(git cat-file -t refs/tags/v1.2.0)" = tag ] || fail "v1.2.0 is missing or not an annotated tag"
[ "$(git rev-parse 'v1.2.0^{commit}')" = "$RELEASE" ] || fail "v1.2.0 points at the wrong commit"
[ "$(git tag -l --format='%(contents)' v1.2.0 | sed '/^$/d')" = "Version 1.2.0" ] || fail "wrong tag message"
[ "$(git cat-file -t refs/tags/latest)" = commit ] || fail "latest is missing or not a lightweight tag"
[ "$(git rev-parse refs/tags/latest)" = "$TIP" ] || fail "latest points at the wrong commit"
[ "$(git rev-parse main)" = "$TIP" ] || fail "main was moved"
echo 1 > /logs/verifier/reward.txt
