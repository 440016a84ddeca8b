#!/bin/bash
cd /app/repo
git config user.email "agent@example.com"
git config user.name "Agent"
git revert --no-edit "$(git log --format=%H --grep='^Lower the request timeout$' main)"
