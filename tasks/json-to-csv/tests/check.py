import csv
import json

users = json.load(open("/tests/users.json"))  # pristine copy of the input
want = [["id", "name", "email"]] + [
    [str(u["id"]), u["name"], u["email"]] for u in sorted(users, key=lambda u: u["id"]) if u["active"]
]
with open("/app/active_users.csv", newline="") as f:
    got = [row for row in csv.reader(f) if row]
assert got == want, f"got {got}\nwant {want}"
print("ok")
