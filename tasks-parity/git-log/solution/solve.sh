#!/bin/bash
set -e
mkdir -p /app/repo && cd /app/repo
git init -q
git config user.name agent && git config user.email agent@example.com
echo alpha > alpha.txt && git add alpha.txt && git commit -q -m "add alpha"
echo beta > beta.txt && git add beta.txt && git commit -q -m "add beta"
