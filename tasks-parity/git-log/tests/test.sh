#!/bin/bash
# Plain git, as a Harbor test runs it under Docker: no safe.directory exception. git refuses a repository
# whose owner is not the user running it ("dubious ownership"), so this checks that the verifier sees the
# agent's files as its own, as Docker's root does.
echo 0 > /logs/verifier/reward.txt
cd /app/repo || exit 0
log=$(git log --format=%s) || exit 0
[ "$log" = "$(printf 'add beta\nadd alpha')" ] || { echo "log: $log"; exit 0; }
[ -z "$(git status --porcelain)" ] || { echo "working tree not clean"; exit 0; }
[ "$(git show HEAD:beta.txt)" = beta ] && [ "$(git show HEAD~1:alpha.txt)" = alpha ] || exit 0
echo 1 > /logs/verifier/reward.txt
