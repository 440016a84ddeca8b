"""The sandbox host's /v1 API fuzzed from its own OpenAPI schema with schemathesis (property-based, on
hypothesis): every route, with valid requests and (where a body or query can be made invalid) invalid
ones, against a real host over real sandboxes. No answer is a 5xx, a refused request adds or removes no
sandbox, and afterwards the host still answers and holds nothing it did not hold before. Below it, a
plain regression test for each 5xx the fuzz found."""

from __future__ import annotations

import io
import tarfile
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from test_sandbox_host import TOKEN, Host
from tests_support import census, grown

# Examples per route and mode, derandomized so that CI runs the same requests each time: the whole fuzz
# takes about 30 s on 2 cores (a DELETE or a create starts a real sandbox).
EXAMPLES = 25
MAX_TIMEOUT_S = 5.0  # a fuzzed command runs at most this long


class Target:
    """The live sandbox the fuzzed sandbox routes are pointed at, made again once a DELETE closed it."""

    def __init__(self, host: Host):
        self.host, self.sid, self.headers = host, "", {}

    def get(self) -> tuple[str, dict[str, str]]:
        if self.sid not in self.host.reg.entries:
            self.sid, self.headers = self.host.create()
        return self.sid, self.headers


def call(host: Host, target: Target, case) -> None:
    """Sends the case with the host's token (and the target's id and token); checks the answer."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if "sid" in (case.path_parameters or {}):
        case.path_parameters["sid"], token = target.get()
        headers.update(token)
    body = case.body
    if isinstance(body, dict) and type(body.get("timeout_s")) in (int, float) and body["timeout_s"] > MAX_TIMEOUT_S:
        body["timeout_s"] = MAX_TIMEOUT_S
    before = set(host.reg.entries)
    r = case.call(base_url=host.url, headers=headers, timeout=60)
    assert r.status_code < 500, f"{r.status_code} {r.text[:500]}\n{case.as_curl_command()}"
    assert host.reg.reserved == 0 and all(e.busy == 0 for e in host.reg.entries.values())
    if r.status_code >= 400:
        assert set(host.reg.entries) == before, f"refused, yet the sandboxes changed: {case.as_curl_command()}"
    elif case.operation.label == "POST /v1/sandboxes":  # close it at once: the next creates find room
        made = r.json()
        assert host.c.delete(f"/v1/sandboxes/{made['id']}", headers={"X-Sandbox-Token": made["token"]}).is_success
    elif case.operation.label == "POST /v1/sandboxes/{sid}/fork":
        for made in r.json()["sandboxes"]:
            assert host.c.delete(f"/v1/sandboxes/{made['id']}", headers={"X-Sandbox-Token": made["token"]}).is_success


def fuzz(host: Host, target: Target, operation, mode: GenerationMode) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def one(case) -> None:
        call(host, target, case)

    one()


def invalidatable(operation) -> bool:
    """Whether schemathesis can make this route's request invalid: it has a body or a query (headers and
    the path are strings of any value)."""
    return bool(operation.body) or any(p.location.value == "query" for p in operation.iter_parameters())


def test_every_v1_route_fuzzed_answers_no_5xx_and_leaves_the_host_clean(backend, base_image):
    host = Host(backend, base_image, capacity=2, max_body=1 << 20)
    try:
        target = Target(host)
        target.get()
        host.c.delete(f"/v1/sandboxes/{target.sid}", headers=target.headers)  # warm: the backend's layer fds
        before = census()
        operations = [result.ok() for result in schemathesis.openapi.from_dict(host.app.openapi()).get_all_operations()]
        assert len(operations) == 17 and all(op.path.startswith("/v1/") for op in operations)
        t0 = time.monotonic()
        for op in operations:
            for mode in (GenerationMode.POSITIVE, *([GenerationMode.NEGATIVE] if invalidatable(op) else [])):
                fuzz(host, target, op, mode)
        assert time.monotonic() - t0 < 120, "the fuzz should stay well under a minute"
        assert host.c.get("/v1/health").json()["ok"] is True
        if target.sid in host.reg.entries:
            assert host.c.delete(f"/v1/sandboxes/{target.sid}", headers=target.headers).is_success
        assert not host.reg.entries and host.reg.reserved == 0
        assert grown(before) == {}, "the fuzz left something on the host"
    finally:
        host.stop()


def _tar(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        member.size = len(data)
        t.addfile(member, io.BytesIO(data))
    return buf.getvalue()


def _fifo(name: str) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type = tarfile.FIFOTYPE
    return member


def _gzipped(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


# a compressed tar too: its body's size would not bound what it expands to (a gzip bomb)
@pytest.mark.parametrize("body", [b"", b"not a tar", _tar(tarfile.TarInfo("../escape"), b"x"), _tar(_fifo("pipe")),
                                  _gzipped(_tar(tarfile.TarInfo("in.txt"), b"x" * 1000))],
                         ids=["empty", "garbage", "member-outside-dest", "fifo-member", "gzip"])
def test_put_tar_refuses_what_is_not_a_tar_it_can_copy_in_with_400_and_changes_nothing(backend, base_image, body):
    """Found by the fuzz: each was a 500 (tarfile's ReadError, or tar_entries' ValueError, unhandled)."""
    host = Host(backend, base_image, capacity=1)
    try:
        sid, tok = host.create()
        r = host.c.post(f"/v1/sandboxes/{sid}/put_tar", params={"dest": "/work/in"}, content=body, headers=tok)
        assert r.status_code == 400 and "not a tar" in r.text, r.text
        r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls -A /work; ls -A /"}, headers=tok)
        assert "in" not in r.json()["stdout"].split() and "escape" not in r.json()["stdout"]
        assert list(host.reg.entries) == [sid]
    finally:
        host.stop()
