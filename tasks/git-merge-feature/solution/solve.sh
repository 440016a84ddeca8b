#!/bin/bash
cd /app/repo
git config user.email "agent@example.com"
git config user.name "Agent"
git checkout -q main
git merge --no-ff --no-edit feature/greeting
