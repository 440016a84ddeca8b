got = open("/app/letter.txt").read()
want = open("/tests/expected_letter.txt").read()
assert got.rstrip("\n") == want.rstrip("\n"), f"letter differs:\n{got}"
for name in ("template.txt", "values.txt"):
    assert open(f"/app/{name}").read() == open(f"/tests/{name}").read(), f"/app/{name} was modified"
print("ok")
