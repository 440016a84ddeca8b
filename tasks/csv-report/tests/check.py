import csv
import json
import random
import subprocess
import sys
import tempfile
from decimal import Decimal


def run(rows):
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False, newline="") as f:
        w = csv.writer(f)
        w.writerow(["date", "category", "amount"])
        w.writerows(rows)
    r = subprocess.run([sys.executable, "/app/report.py", f.name], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def expected(rows):
    totals = {}
    for _, cat, amount in rows:
        if amount.strip():
            totals[cat] = totals.get(cat, Decimal(0)) + Decimal(amount)
    return {k: float(round(v, 2)) for k, v in sorted(totals.items())}


rng = random.Random(2024)
cats = ["food", "books", "travel, local", "rent", "Gifts & cards", "z last", "a first"]
suites = [
    [["2024-01-03", "food", "12.50"], ["2024-01-04", "books", "20"], ["2024-01-04", "food", "-2.25"],
     ["2024-01-05", "travel, local", "3.10"], ["2024-01-06", "books", "11.5"], ["2024-01-07", "food", ""]],
    [["2024-02-01", "only", "0.1"], ["2024-02-01", "only", "0.2"]],
]
for _ in range(8):
    suites.append([[f"2024-03-{rng.randint(1, 28):02d}", rng.choice(cats),
                    rng.choice(["", f"{rng.randint(-5000, 90000) / 100:.2f}", str(rng.randint(0, 99))])]
                   for _ in range(rng.randint(1, 80))])
for rows in suites:
    got, want = run(rows), expected(rows)
    assert list(got) == list(want), f"keys {list(got)} != {list(want)}"
    for k in want:
        assert abs(got[k] - want[k]) < 0.001, f"{k}: {got[k]} != {want[k]}"
print("ok")
