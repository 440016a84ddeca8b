got = [l.split() for l in open("/app/errors_per_day.txt").read().splitlines() if l.strip()]
want = [l.split() for l in open("/tests/expected.txt").read().splitlines()]
assert got == want, f"got {got}\nwant {want}"
print("ok")
