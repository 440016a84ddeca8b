#!/bin/bash
cd /app/repo
git config user.email "agent@example.com"
git config user.name "Agent"
git tag -a v1.2.0 -m "Version 1.2.0" "$(git log --format=%H --grep='^Release 1.2.0$' main)"
git tag latest main
