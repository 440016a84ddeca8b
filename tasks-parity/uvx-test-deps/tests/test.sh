#!/bin/bash
# Terminal-Bench 2's prologue and test command: uv from its installer, then uvx builds a throwaway
# environment with the tests' own packages, fetched from the package index at test time.
echo 0 > /logs/verifier/reward.txt
apt-get update >/dev/null && apt-get install -y curl >/dev/null || exit 0
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh || exit 0
source "$HOME/.local/bin/env"
uvx -p 3.11 -w pytest==8.4.1 -w six==1.16.0 pytest /tests/test_greet.py -rA && echo 1 > /logs/verifier/reward.txt
