"""Worked examples of furlong's Python API (docs/environments.md): an environment (guess_number.py), extra
tools (tools.py) and reward functions (rewards.py), each run by tests/test_user_api.py; and a prompt dataset
with its reward function (prompts_arith/, docs/prompts.md), run by tests/test_prompts.py."""
