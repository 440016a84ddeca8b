import itertools
import random
import subprocess
import sys


def rle(cmd, s):
    r = subprocess.run([sys.executable, "/app/rle.py", cmd, s], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, f"{cmd} {s!r}: {r.stderr}"
    assert r.stdout.endswith("\n") and r.stdout.count("\n") == 1, f"{cmd} {s!r}: output {r.stdout!r} is not one line"
    return r.stdout[:-1]


def encode(s):
    return "".join(f"{len(list(g))}{c}" for c, g in itertools.groupby(s))


rng = random.Random(77)
samples = ["", "a", "aaabccdddd", "abc", "z" * 12, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"]
samples += ["".join(rng.choice("ab") * rng.randint(1, 15) for _ in range(rng.randint(1, 8))) for _ in range(12)]
for s in samples:
    assert rle("encode", s) == encode(s), f"encode {s!r}: got {rle('encode', s)!r}, want {encode(s)!r}"
    assert rle("decode", encode(s)) == s, f"decode {encode(s)!r}"
assert rle("decode", "3a1b12c") == "aaab" + "c" * 12
print("ok")
