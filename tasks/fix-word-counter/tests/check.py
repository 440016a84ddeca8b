import collections
import random
import subprocess
import sys
import tempfile


def expected(text, n):
    c = collections.Counter(w.lower() for w in text.split())
    return [f"{w} {k}" for w, k in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


rng = random.Random(99)
vocab = ["alpha", "Beta", "gamma", "DELTA", "eps", "zeta", "eta", "theta", "x", "y"]
texts = [
    "the cat  sat on the mat\nThe dog sat\ton the log\n\nzebra apple zebra apple\n",
    "b a c\n",
    "   leading and trailing   \n\n\n",
    "one\n",
]
for _ in range(30):
    seps = [" ", "  ", "\t", "\n", " \n ", "\n\n"]
    texts.append("".join(rng.choice(vocab) + rng.choice(seps) for _ in range(rng.randint(1, 60))))
for i, text in enumerate(texts):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    for n in (1, 3, 5, 20):
        r = subprocess.run([sys.executable, "/app/wordcount.py", f.name, str(n)], capture_output=True, text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        got = [l for l in r.stdout.splitlines() if l.strip()]
        assert got == expected(text, n), f"text {text!r} N={n}: got {got}, want {expected(text, n)}"
print("ok")
