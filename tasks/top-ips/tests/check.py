lines = [l.split() for l in open("/app/top_ips.txt").read().splitlines() if l.strip()]
want = [["41", "10.0.4.17"], ["37", "192.168.1.23"], ["30", "172.16.0.5"]]
assert lines == want, f"got {lines}, want {want}"
print("ok")
