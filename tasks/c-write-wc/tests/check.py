import random
import subprocess

subprocess.run(["gcc", "-O2", "-o", "/tmp/mywc_verify", "/app/mywc.c"], check=True, timeout=60)


def expected(data):
    lines = data.count(b"\n")
    return f"{lines} {len(data.split())} {len(data)}"


rng = random.Random(8)
inputs = [b"", b"hello", b"hello world\n", b"  two\t\twords  \n\n", b"a\nb\nc\n", b"no newline at end",
          b"nul\x00inside word\n", bytes(range(256)) * 3]
inputs.append(b"".join(rng.choice([b"word", b" ", b"\n", b"\t", b"xyz", b"\r\n"]) for _ in range(300000)))
for data in inputs:
    out = subprocess.run(["/tmp/mywc_verify"], input=data, capture_output=True, timeout=20, check=True).stdout
    assert out.decode().split() == expected(data).split(), f"input {data[:40]!r}...: got {out!r}, want {expected(data)!r}"
print("ok")
