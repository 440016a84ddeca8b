import subprocess


def primes_below(n):
    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]


with open("/app/primes", "rb") as f:
    assert f.read(4) == b"\x7fELF", "/app/primes is not an ELF executable"
out = subprocess.run(["/app/primes", "50"], capture_output=True, text=True, timeout=10, check=True).stdout
assert out.split() == [str(p) for p in primes_below(50)], out
saved = open("/app/primes_100.txt").read().split()
assert saved == [str(p) for p in primes_below(100)], saved
print("ok")
