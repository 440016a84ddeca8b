#!/bin/bash
# Terminal-Bench 2's uvx form: a throwaway environment on the image's Python with pinned pytest and the
# CTRF report plugin. Offline it resolves from the verifier toolchain's wheels (UV_FIND_LINKS,
# UV_OFFLINE=1), and `-p` finds the image's own python3.11 (UV_PYTHON_DOWNLOADS=never). TB2 writes
# `-p 3.13`, which works the same on a python:3.13 (or 3.12, the nearest) stand-in: bench/standins_check.py.
uvx \
  -p 3.11 \
  -w pytest==8.4.1 \
  -w pytest-json-ctrf==0.3.5 \
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
