"""Regression tests for what the schema fuzz of the sandbox host found (each was a 500)."""

from __future__ import annotations

import io
import tarfile

import pytest
from test_sandbox_host import Host


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


@pytest.mark.parametrize("body", [b"", b"not a tar", _tar(tarfile.TarInfo("../escape"), b"x"), _tar(_fifo("pipe"))],
                         ids=["empty", "garbage", "member-outside-dest", "fifo-member"])
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
