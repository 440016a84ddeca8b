#!/bin/bash
# Builds /app/repo with fixed authors and dates, so its commit ids are the same in every build.
set -e
export GIT_AUTHOR_NAME=Dev GIT_AUTHOR_EMAIL=dev@example.com GIT_COMMITTER_NAME=Dev GIT_COMMITTER_EMAIL=dev@example.com
t=1700000000
commit() { t=$((t + 3600)); GIT_AUTHOR_DATE="@$t +0000" GIT_COMMITTER_DATE="@$t +0000" git commit -q -m "$1"; }
mkdir -p /app/repo && cd /app/repo
git init -q -b main
for v in 1.0.0 1.1.0 1.2.0; do
  echo "$v" > VERSION
  echo "change for $v" >> CHANGELOG
  git add VERSION CHANGELOG && commit "Prepare $v"
  echo "released $v" >> CHANGELOG
  git add CHANGELOG && commit "Release $v"
done
echo "work in progress" >> CHANGELOG
git add CHANGELOG && commit "Start 1.3.0"
git tag -a v1.0.0 -m "Version 1.0.0" "HEAD~5"
