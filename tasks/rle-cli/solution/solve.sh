#!/bin/bash
cat > /app/rle.py <<'PY'
import itertools
import re
import sys

cmd, text = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
if cmd == "encode":
    print("".join(f"{len(list(g))}{c}" for c, g in itertools.groupby(text)))
elif cmd == "decode":
    print("".join(c * int(n) for n, c in re.findall(r"(\d+)([a-z])", text)))
else:
    sys.exit(f"usage: {sys.argv[0]} encode|decode STRING")
PY
