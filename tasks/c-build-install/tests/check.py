import os
import shutil
import subprocess

BIN = "/usr/local/bin/rot13"
assert shutil.which("rot13") == BIN, f"rot13 on PATH is {shutil.which('rot13')}, not {BIN}"
with open(BIN, "rb") as f:
    assert f.read(4) == b"\x7fELF", f"{BIN} is not a compiled executable"


def rot13(data: bytes) -> bytes:
    out = subprocess.run(["rot13"], input=data, capture_output=True, timeout=10, check=True, cwd="/")
    return out.stdout


assert rot13(b"Hello, World!\n") == b"Uryyb, Jbeyq!\n"
text = bytes(range(256)) * 40
assert rot13(rot13(text)) == text
letters = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
assert rot13(letters) == letters[13:26] + letters[:13] + letters[39:] + letters[26:39]
assert os.stat(BIN).st_mode & 0o111, f"{BIN} is not executable"
print("ok")
