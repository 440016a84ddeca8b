got = [l.split() for l in open("/app/top_words.txt").read().splitlines() if l.strip()]
want = [["the", "60"], ["and", "47"], ["of", "39"], ["lantern", "31"], ["river", "26"]]
assert got == want, f"got {got}, want {want}"
print("ok")
