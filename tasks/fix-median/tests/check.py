import random
import statistics
import subprocess
import sys

sys.path.insert(0, "/app")
import stats  # noqa: E402

rng = random.Random(1234)
cases = [[1], [1, 2], [2, 1], [5, 3, 9], [4, 1, 3, 2], [10, 10, 20, 20], [-3.5, 2.25, 0, 8, 1, 7]]
cases += [[rng.randint(-100, 100) for _ in range(rng.randint(1, 30))] for _ in range(200)]
for xs in cases:
    assert abs(stats.median(list(xs)) - statistics.median(xs)) < 1e-9, f"median({xs})"
    assert abs(stats.mean(list(xs)) - statistics.fmean(xs)) < 1e-9, f"mean({xs})"
    assert abs(stats.variance(list(xs)) - statistics.pvariance(xs)) < 1e-6, f"variance({xs})"
for f in (stats.mean, stats.median):
    try:
        f([])
    except ValueError:
        pass
    else:
        raise AssertionError(f"{f.__name__}([]) must raise ValueError")
out = subprocess.run([sys.executable, "report.py", "numbers.txt"], cwd="/app", capture_output=True, text=True, check=True).stdout
assert "median   7.500" in out, out
print("ok")
