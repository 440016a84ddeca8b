#!/bin/bash
# Builds /app/repo with fixed authors and dates, so its commit ids are the same in every build.
set -e
export GIT_AUTHOR_NAME=Dev GIT_AUTHOR_EMAIL=dev@example.com GIT_COMMITTER_NAME=Dev GIT_COMMITTER_EMAIL=dev@example.com
t=1700000000
commit() { t=$((t + 3600)); GIT_AUTHOR_DATE="@$t +0000" GIT_COMMITTER_DATE="@$t +0000" git commit -q -m "$1"; }
mkdir -p /app/repo && cd /app/repo
git init -q -b main
printf '[service]\nname = api\ntimeout = 30\nworkers = 4\nlog_level = info\nbind = 0.0.0.0\n\n[client]\nretries = 3\n' > config.ini
git add config.ini && commit "Add config"
printf 'print("serving")\n' > serve.py
git add serve.py && commit "Add server"
printf '[service]\nname = api\ntimeout = 1\nworkers = 4\nlog_level = info\nbind = 0.0.0.0\n\n[client]\nretries = 3\n' > config.ini
git add config.ini && commit "Lower the request timeout"
printf '[service]\nname = api\ntimeout = 1\nworkers = 4\nlog_level = info\nbind = 0.0.0.0\n\n[client]\nretries = 5\n' > config.ini
git add config.ini && commit "Retry more often"
printf 'print("serving on port 80")\n' > serve.py
git add serve.py && commit "Log the port"
