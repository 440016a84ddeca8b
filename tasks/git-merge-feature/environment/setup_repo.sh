#!/bin/bash
# Builds /app/repo with fixed authors and dates, so its commit ids are the same in every build.
set -e
export GIT_AUTHOR_NAME=Dev GIT_AUTHOR_EMAIL=dev@example.com GIT_COMMITTER_NAME=Dev GIT_COMMITTER_EMAIL=dev@example.com
t=1700000000
commit() { t=$((t + 3600)); GIT_AUTHOR_DATE="@$t +0000" GIT_COMMITTER_DATE="@$t +0000" git commit -q -m "$1"; }
mkdir -p /app/repo && cd /app/repo
git init -q -b main
printf 'def main():\n    print("app")\n' > app.py
git add app.py && commit "Add app"
printf 'Usage: python3 app.py\n' > README
git add README && commit "Add README"
git checkout -q -b feature/greeting
printf 'def greet(name):\n    return f"Hello, {name}!"\n' > greeting.py
git add greeting.py && commit "Add greeting helper"
printf 'def greet(name):\n    return f"Hello, {name}!"\n\n\ndef farewell(name):\n    return f"Bye, {name}."\n' > greeting.py
git add greeting.py && commit "Add farewell"
git checkout -q main
printf 'Usage: python3 app.py\nLicense: MIT\n' > README
git add README && commit "Mention the license"
