#!/bin/bash
# Checks /app/project: branch main, exactly one commit "Initial commit" holding the project files and
# .gitignore but nothing from build/, and a clean working tree.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /app/project || exit 0
fail() { echo "FAIL: $*"; exit 0; }

[ "$(git rev-parse --abbrev-ref HEAD)" = main ] || fail "current branch is not main"
[ "$(git rev-list --count HEAD)" = 1 ] || fail "expected exactly one commit"
[ "$(git log -1 --format=%s)" = "Initial commit" ] || fail "wrong commit message"
files=$(git ls-tree -r --name-only HEAD | sort | tr '\n' ' ')
[ "$files" = ".gitignore README.md src/main.py src/util.py " ] || fail "committed files: $files"
git check-ignore -q build/widget.bin || fail "build/ is not ignored"
[ -z "$(git status --porcelain)" ] || fail "working tree is not clean"
echo 1 > /logs/verifier/reward.txt
