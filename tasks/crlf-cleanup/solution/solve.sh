#!/bin/bash
python3 - <<'PY'
p = "/app/notes.txt"
text = open(p, newline="").read().replace("\r\n", "\n").replace("\r", "")
lines = [line.rstrip(" \t") for line in text.split("\n")]
open(p, "w", newline="").write("\n".join(lines).rstrip("\n") + "\n")
PY
