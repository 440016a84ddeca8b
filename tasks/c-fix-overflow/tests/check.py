import subprocess

NS = [1, 2, 3, 10, 1000, 65536, 100000, 999999, 1000000]


def check(binary):
    for n in NS:
        out = subprocess.run([binary, str(n)], capture_output=True, text=True, timeout=10, check=True).stdout
        assert out.strip() == str(n * (n + 1) * (2 * n + 1) // 6), f"{binary} {n}: got {out!r}"


check("/app/sumsq")  # the agent's binary
subprocess.run(["gcc", "-O2", "-o", "/tmp/sumsq_verify", "/app/sumsq.c"], check=True, timeout=60)
check("/tmp/sumsq_verify")  # and the fixed source, freshly compiled
print("ok")
