import http.client
import time


def req(method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", 8088, timeout=5)
    try:
        conn.request(method, path, body=body.encode() if body is not None else None)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


for attempt in range(20):  # the server may still be starting
    try:
        req("GET", "/kv/warmup")
        break
    except OSError:
        time.sleep(0.5)

assert req("GET", "/kv/colour")[0] == 404
assert req("PUT", "/kv/colour", "blue")[0] == 200
assert req("GET", "/kv/colour") == (200, "blue")
assert req("PUT", "/kv/colour", "deep green")[0] == 200
assert req("GET", "/kv/colour") == (200, "deep green")
value = "line one\nline two: ünïcödé = 1 & 2"
assert req("PUT", "/kv/multi_line-2", value)[0] == 200
assert req("GET", "/kv/multi_line-2") == (200, value)
assert req("PUT", "/kv/empty", "")[0] == 200
assert req("GET", "/kv/empty") == (200, "")
assert req("DELETE", "/kv/colour")[0] == 200
assert req("GET", "/kv/colour")[0] == 404
assert req("DELETE", "/kv/colour")[0] == 404
assert req("GET", "/kv/multi_line-2") == (200, value)
for i in range(30):
    assert req("PUT", f"/kv/k{i}", str(i * i))[0] == 200
assert all(req("GET", f"/kv/k{i}") == (200, str(i * i)) for i in range(30))
print("ok")
