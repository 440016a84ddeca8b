#!/bin/bash
# Checks that main's HEAD in /app/repo is a merge commit whose parents are the old main tip and the
# feature tip (commit ids are fixed by setup_repo.sh), containing both branches' changes.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /app/repo || exit 0
fail() { echo "FAIL: $*"; exit 0; }
MAIN_TIP=0e29c322083bb9253492de9ab6c79c496f110c0e
FEATURE_TIP=d28f59acc31536d44f5bdda76bb882767c794a5b

[ "$(git rev-parse --abbrev-ref HEAD)" = main ] || fail "main is not checked out"
[ "$(git rev-parse feature/greeting)" = "$FEATURE_TIP" ] || fail "feature/greeting was changed or deleted"
[ "$(git log -1 --format=%P main)" = "$MAIN_TIP $FEATURE_TIP" ] || fail "main is not a merge of the two tips"
git show main:greeting.py | grep -q "def farewell" || fail "greeting.py from the feature is missing"
git show main:README | grep -q "License: MIT" || fail "README change from main is missing"
[ -z "$(git status --porcelain --untracked-files=no)" ] || fail "uncommitted changes"
echo 1 > /logs/verifier/reward.txt
