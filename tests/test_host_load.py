"""The sandbox host under load: more clients than it has room for create, use and close real sandboxes on
loopback for a bounded time, those refused (429) retrying after Retry-After; afterwards the host holds
nothing it did not hold before (a sandbox entry, a process, an fd, a mount, a cgroup)."""

from __future__ import annotations

import base64
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
from test_sandbox_host import TOKEN, Host
from tests_support import census, grown

CLIENTS, CAPACITY, SECONDS = 6, 4, 12.0
FIRST_TURN_S = 60.0


def one_client(url: str, n: int, deadline: float) -> Counter:
    """Create, exec, write and read back a file, leave a background command running, close; until
    `deadline`. Counts its cycles and its 429s."""
    seen: Counter = Counter()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        # past the deadline only for a first cycle: nothing promises a refused client its turn while others
        # hold the room (one lost every race on a loaded machine), but room comes once they stop
        while time.monotonic() < deadline or (not seen["cycles"] and time.monotonic() < deadline + FIRST_TURN_S):
            r = c.post("/v1/sandboxes", json={"memory_mb": 256})
            if r.status_code == 429:
                seen["429"] += 1
                time.sleep(float(r.headers["Retry-After"]))
                continue
            assert r.status_code == 200, r.text
            sid, tok = r.json()["id"], {"X-Sandbox-Token": r.json()["token"]}
            data = os.urandom(3000)
            r = c.post(f"/v1/sandboxes/{sid}/files/write", headers=tok,
                       json={"path": f"/work/c{n}", "data_b64": base64.b64encode(data).decode()})
            assert r.status_code == 200, r.text
            r = c.post(f"/v1/sandboxes/{sid}/exec", headers=tok,
                       json={"cmd": f"sleep 300 & wc -c < /work/c{n}; echo {n} > /work/n"})
            assert r.json()["stdout"] == "3000\n", r.text
            r = c.post(f"/v1/sandboxes/{sid}/files/read", headers=tok, json={"path": f"/work/c{n}"})
            assert base64.b64decode(r.json()["data_b64"]) == data
            r = c.post(f"/v1/sandboxes/{sid}/files/read", headers=tok, json={"path": "/work/n"})
            assert base64.b64decode(r.json()["data_b64"]) == f"{n}\n".encode()  # its own sandbox, no other's
            assert c.delete(f"/v1/sandboxes/{sid}", headers=tok).status_code == 200
            seen["cycles"] += 1
    return seen


def test_clients_past_capacity_get_429_retry_and_leave_nothing(backend, base_image):
    host = Host(backend, base_image, capacity=CAPACITY)
    try:
        sid, tok = host.create()  # warm: the backend's layer fds, the host client's connection
        host.c.delete(f"/v1/sandboxes/{sid}", headers=tok)
        before = census()
        sid, tok = host.create()
        assert {"processes", "cgroups", "fds"} <= set(grown(before, wait_s=0)), "the census sees a live sandbox"
        host.c.delete(f"/v1/sandboxes/{sid}", headers=tok)
        deadline = time.monotonic() + SECONDS
        with ThreadPoolExecutor(CLIENTS) as pool:
            runs = [pool.submit(one_client, host.url, n, deadline) for n in range(CLIENTS)]
            counts = [run.result(timeout=SECONDS + FIRST_TURN_S + 120) for run in runs]
        assert all(c["cycles"] >= 1 for c in counts), counts  # every client got its turn
        assert sum(c["429"] for c in counts) >= 1, counts  # more clients than room: some were told to wait
        assert not host.reg.entries and host.reg.reserved == 0
        assert host.c.get("/v1/metrics").json()["active"] == 0
        assert grown(before) == {}, "the load left something on the host"
    finally:
        host.stop()
