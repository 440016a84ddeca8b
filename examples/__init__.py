"""Worked examples of furlong's Python API (docs/environments.md): an environment (guess_number.py), extra
tools (tools.py) and reward functions (rewards.py), each run by tests/test_user_api.py."""
