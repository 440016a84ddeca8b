got = open("/app/notes.txt", "rb").read()
want = open("/tests/expected_notes.txt", "rb").read()
assert b"\r" not in got, "carriage returns remain"
assert got == want, f"content differs:\n{got!r}\nwant:\n{want!r}"
print("ok")
