#!/bin/bash
# Terminal-Bench 2's usual prologue, under `set -e` as many TB2 tests write it. Offline, furlong's verifier
# toolchain answers it: `apt-get install -y curl` succeeds without fetching, and `curl ... astral.sh ... | sh`
# gets an installer that links the toolchain's uv into ~/.local/bin and writes its `env`.
set -e
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
set +e

if [ "$PWD" = "/" ]; then
    echo "Error: No working directory set. Please set a WORKDIR in your Dockerfile before running this script."
    exit 1
fi

uv venv .tbench-testing
source .tbench-testing/bin/activate
uv pip install pytest==8.4.1
uv run pytest /tests/test_outputs.py -rA

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
