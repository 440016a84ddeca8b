#!/bin/bash
python3 - <<'PY'
text = open("/app/template.txt").read()
for line in open("/app/values.txt"):
    key, sep, value = line.rstrip("\n").partition("=")
    if sep:
        text = text.replace("{{" + key + "}}", value)
open("/app/letter.txt", "w").write(text)
PY
