import time
import urllib.error
import urllib.request

BASE = "http://127.0.0.1:8123"


def get(path):
    with urllib.request.urlopen(BASE + path, timeout=5) as r:
        return r.status, r.read()


for attempt in range(20):  # the server may still be starting
    try:
        get("/index.html")
        break
    except OSError:
        time.sleep(0.5)
for path in ("/index.html", "/data/info.json"):
    status, body = get(path)
    assert status == 200 and body == open("/tests/site" + path, "rb").read(), f"{path}: {status} {body[:80]!r}"
try:
    get("/missing.html")
    raise AssertionError("/missing.html should be 404")
except urllib.error.HTTPError as e:
    assert e.code == 404, e.code
print("ok")
