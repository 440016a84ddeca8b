want = ["archive/2023/jan.log", "archive/Zeta.log", "services/api/today.log", "services/web/Old.log",
        "services/web/access.log", "tmp/space name.log", "top.log"]
want.sort(key=lambda s: s.encode())  # byte order
got = [l for l in open("/app/big_logs.txt").read().splitlines() if l.strip()]
assert got == want, f"got {got}\nwant {want}"
print("ok")
