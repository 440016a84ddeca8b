#!/bin/bash
cd /app/project
git init -q -b main
git config user.email "agent@example.com"
git config user.name "Agent"
echo "build/" > .gitignore
git add -A
git commit -q -m "Initial commit"
