#!/bin/bash
# Checks that /app/repo's main still contains the original tip (commit ids are fixed by setup_repo.sh),
# has exactly one new commit that reverts "Lower the request timeout", and keeps the later changes.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /app/repo || exit 0
fail() { echo "FAIL: $*"; exit 0; }
OLD_TIP=a4e29eb2bced332af948ba40bf98d01c010f57a8

[ "$(git rev-parse --abbrev-ref HEAD)" = main ] || fail "main is not checked out"
[ "$(git rev-parse main~1)" = "$OLD_TIP" ] || fail "main is not exactly one new commit on top of the old history"
git show main:config.ini | grep -qx "timeout = 30" || fail "timeout was not restored to 30"
git show main:config.ini | grep -qx "retries = 5" || fail "the later 'retries = 5' change was lost"
git show main:serve.py | grep -q "port 80" || fail "the later serve.py change was lost"
[ "$(git diff --name-only main~1 main)" = config.ini ] || fail "the new commit must only change config.ini"
[ -z "$(git status --porcelain --untracked-files=no)" ] || fail "uncommitted changes"
echo 1 > /logs/verifier/reward.txt
