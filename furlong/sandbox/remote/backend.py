"""The `remote` sandbox backend: sandboxes on `furlong sandbox serve` hosts, through their /v1 API.

A sandbox here keeps the Sandbox protocol's whole meaning, the verifier identity and change tracking
included, so the reward's integrity checks run through a host as they run locally. Failures are told
apart the way the episode runner needs: a refusal is SandboxError, a sandbox that died on a live host is
SandboxDied (the agent may have done that), and a host that stopped answering or restarted is HostLost,
which the agent cannot cause (furlong.agent.runner runs such an episode again).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from furlong.sandbox.base import (
    ExecResult,
    Guarantees,
    HostLost,
    PythonRun,
    PythonSpec,
    SandboxBackend,
    SandboxDied,
    SandboxError,
    SandboxSpec,
    SnapshotRef,
)
from furlong.sandbox.changes import Change
from furlong.sandbox.listing import Entry
from furlong.sandbox.network import NetworkPolicy
from furlong.sandbox.remote.hosts import Host, Hosts, check
from furlong.sandbox.tarball import tar_dir

HTTP_SLACK_S = 30.0  # past a command's own timeout, for the host to answer
FILE_TIMEOUT_S = 120.0
START_WAIT_S = 120.0  # how long a create waits for room while every host is at capacity


class RemoteSandbox:
    backend = "remote"  # what an episode's receipt names (furlong.tasks.receipt): a sandbox host's

    def __init__(self, hosts: Hosts, host: Host, created: dict[str, Any]):
        self._hosts, self.host = hosts, host
        self.id, self.boot = created["id"], created["boot"]
        self._headers = {"X-Sandbox-Token": created["token"]}
        self.verifier_uid: int | None = created["verifier_uid"]
        self.agent_uid: int = created.get("agent_uid", 0)
        self._tracking: bool = created["change_tracking"]
        self._closed = False
        self._death: str | None = None
        self._paused = False

    @property
    def alive(self) -> bool:
        return not self._closed and self._death is None

    async def _failed(self, what: str, why: str, cause: BaseException | None = None) -> Exception:
        """HostLost where the host is gone or restarted, else SandboxDied (this sandbox alone is gone)."""
        if await self._hosts.lost(self.host, self.boot):
            self._death = f"host {self.host.url} lost"
            return HostLost(f"sandbox host {self.host.url} lost during {what}: {why}")
        self._death = why
        return SandboxDied(f"sandbox {self.id} on {self.host.url} gone during {what}: {why}")

    async def _send(self, method: str, path: str, what: str, timeout_s: float, **kw: Any) -> httpx.Response:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._death is not None:
            raise SandboxDied(f"sandbox {self.id}: {self._death}")
        try:
            r = await self.host.client().request(
                method, f"/v1/sandboxes/{self.id}{path}", headers=self._headers, timeout=timeout_s + HTTP_SLACK_S, **kw
            )
        except httpx.TransportError as exc:
            raise await self._failed(what, f"{type(exc).__name__}: {exc}", exc) from exc
        if r.status_code in (404, 410):
            raise await self._failed(what, _detail(r))
        if r.status_code == 409:
            raise SandboxError(f"{what}: {_detail(r)}")
        check(r, f"{self.host.url} {what}")
        return r

    async def exec(
        self,
        cmd: str,
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        as_verifier: bool = False,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecResult:
        body = {"cmd": cmd, "timeout_s": timeout_s, "cwd": cwd, "env": env, "as_verifier": as_verifier}
        if on_output is not None:
            return await self._exec_streamed(body, on_output)
        r = await self._send("POST", "/exec", "exec", timeout_s, json=body)
        return ExecResult(**r.json())

    async def _exec_streamed(self, body: dict, on_output: Callable[[str, bytes], None]) -> ExecResult:
        """The host's NDJSON stream: output chunks as they come, then the result (or an error)."""
        url = f"/v1/sandboxes/{self.id}/exec"
        try:
            async with self.host.client().stream(
                "POST",
                url,
                json={**body, "stream": True},
                headers=self._headers,
                timeout=body["timeout_s"] + HTTP_SLACK_S,
            ) as r:
                if r.status_code >= 400:
                    await r.aread()
                    if r.status_code in (404, 410):
                        raise await self._failed("exec", _detail(r))
                    check(r, f"{self.host.url} exec")
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if "result" in event:
                        return ExecResult(**event["result"])
                    if "error" in event:
                        err = event["error"]
                        if err.get("status") == 410:
                            raise await self._failed("exec", err.get("detail", ""))
                        raise SandboxError(f"exec: {err.get('detail', err)}")
                    for stream in ("stdout", "stderr"):
                        if stream in event:
                            on_output(stream, base64.b64decode(event[stream]))
        except httpx.TransportError as exc:
            raise await self._failed("exec", f"{type(exc).__name__}: {exc}", exc) from exc
        raise await self._failed("exec", "the output stream ended without a result")

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, as_verifier: bool = False) -> None:
        raw = data.encode() if isinstance(data, str) else data
        body = {"path": path, "data_b64": base64.b64encode(raw).decode(), "mode": mode, "as_verifier": as_verifier}
        await self._send("POST", "/files/write", "write_file", FILE_TIMEOUT_S, json=body)

    async def read_file(self, path: str, as_verifier: bool = False) -> bytes:
        r = await self._send(
            "POST", "/files/read", "read_file", FILE_TIMEOUT_S, json={"path": path, "as_verifier": as_verifier}
        )
        return base64.b64decode(r.json()["data_b64"])

    async def list_dir(self, path: str, depth: int = 1, as_verifier: bool = False) -> list[Entry]:
        """The entries under `path` (to `depth` levels), as that identity sees them (furlong.sandbox.listing)."""
        r = await self._send(
            "POST",
            "/files/list",
            "list_dir",
            FILE_TIMEOUT_S,
            json={"path": path, "depth": depth, "as_verifier": as_verifier},
        )
        return [Entry(**e) for e in r.json()["entries"]]

    async def put_dir(self, src: Path, dest: str, as_verifier: bool = False) -> None:
        await self.put_tar(await asyncio.to_thread(tar_dir, Path(src)), dest, as_verifier)

    async def put_tar(self, data: bytes, dest: str, as_verifier: bool = False) -> None:
        params = {"dest": dest, "as_verifier": json.dumps(as_verifier)}
        await self._send("POST", "/put_tar", "put_tar", FILE_TIMEOUT_S, params=params, content=data)

    async def set_network(self, policy: NetworkPolicy, verifier_only: bool = False) -> None:
        """furlong.sandbox.base.NetworkSwitching, on the sandbox's host (which refuses what it cannot do)."""
        await self._send(
            "POST",
            "/network",
            "set_network",
            FILE_TIMEOUT_S,
            json={"network": policy_body(policy), "verifier_only": verifier_only},
        )

    async def changes(self, roots: Sequence[str]) -> tuple[Change, ...] | None:
        if not self._tracking:
            return None
        r = await self._send("POST", "/changes", "changes", FILE_TIMEOUT_S, json={"paths": list(roots)})
        found = r.json()["changes"]
        return None if found is None else tuple(Change(**c) for c in found)

    async def image_has(self, paths: Sequence[str]) -> frozenset[str] | None:
        if not self._tracking:
            return None
        r = await self._send("POST", "/image_has", "image_has", FILE_TIMEOUT_S, json={"paths": list(paths)})
        found = r.json()["paths"]
        return None if found is None else frozenset(found)

    async def snapshot(self) -> SnapshotRef:
        """furlong.sandbox.base.Snapshotting, on the sandbox's host: the ref names that host and its token."""
        j = (await self._send("POST", "/snapshot", "snapshot", FILE_TIMEOUT_S)).json()
        return SnapshotRef(
            tuple(j["layers"]), j["image_digest"], j["size_bytes"], j["expires_at"], self.host.url, j["token"]
        )

    async def fork(self, n: int) -> list[RemoteSandbox]:
        r = await self._send("POST", "/fork", "fork", START_WAIT_S, json={"n": n})
        made = [RemoteSandbox(self._hosts, self.host, c) for c in r.json()["sandboxes"]]
        self.host.active += len(made)
        self.host.started += len(made)
        return made

    async def pause(self) -> None:
        await self._send("POST", "/pause", "pause", FILE_TIMEOUT_S)
        self._paused = True

    async def resume(self) -> None:
        await self._send("POST", "/resume", "resume", FILE_TIMEOUT_S)
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.host.active -= 1
        if self._death is not None and self._death.startswith("host "):
            return  # its host is gone, and the sandbox with it
        try:
            r = await self.host.client().delete(f"/v1/sandboxes/{self.id}", headers=self._headers, timeout=30.0)
        except httpx.TransportError as exc:
            raise SandboxError(f"closing sandbox {self.id} on {self.host.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 404:  # reaped already
            check(r, f"{self.host.url} close")


def _missing_layers(r: httpx.Response) -> list[str] | None:
    """The layers a host's 409 says it lacks (furlong.sandbox.host.bodies' `create_spec`), else None."""
    if r.status_code != 409:
        return None
    try:
        detail = r.json().get("detail")
    except ValueError:
        return None
    return detail.get("missing_layers") if isinstance(detail, dict) else None


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except ValueError:
        return r.text


def policy_body(policy: NetworkPolicy) -> dict[str, Any]:
    return {"mode": policy.mode, "hosts": list(policy.hosts)}


def create_body(spec: SandboxSpec) -> dict[str, Any]:
    """The host's create request for `spec`: the image by content (digest and layers), limits, policy."""
    lim = spec.limits
    # verifier_env stays here: the verifier passes it with each of its commands
    image = {k: v for k, v in dataclasses.asdict(spec.image).items() if k != "verifier_env"}
    return {
        "image": image,
        "network": policy_body(spec.network),
        "network_phases": [policy_body(p) for p in spec.network_phases],
        "cpus": lim.cpus,
        "memory_mb": lim.memory_mb,
        "pids": lim.pids,
        "disk_mb": lim.disk_mb,
        "lifetime_s": lim.lifetime_s,
        "seccomp": spec.syscalls.enabled,
        "allow_syscalls": list(spec.syscalls.allow),
    }


class RemoteBackend:
    """Sandboxes on the least loaded host that answers. A host that lacks an image's layers gets them
    built by `provide` (furlong.sandbox.remote.images) and the create is tried once more there. Family
    generators (`run_python`) run on the backend `local` makes (this machine's own), made on first use."""

    name = "remote"
    # what its hosts' bwrap backends give where they have subordinate ids (each sandbox says what it got:
    # verifier_uid, change_tracking; an episode records its own)
    guarantees = Guarantees(verifier_identity=True, tamper_tracking=True)

    def __init__(
        self,
        hosts: Hosts,
        provide: Callable[[Host, list[str]], Any] | None = None,
        local: Callable[[], SandboxBackend] | None = None,
    ):
        self.hosts, self._provide, self._make_local = hosts, provide, local
        self._local: SandboxBackend | None = None

    async def create(self, spec: SandboxSpec, from_snapshot: SnapshotRef | None = None) -> RemoteSandbox:
        body = create_body(spec)
        if from_snapshot is not None:
            return await self._restore(body, from_snapshot)
        deadline = time.monotonic() + START_WAIT_S
        while True:
            errors: list[str] = []
            full: list[Host] = []
            for host in self.hosts.ranked():
                created = await self._create_on(host, body, errors, full)
                if created is not None:
                    host.active += 1
                    host.started += 1
                    return RemoteSandbox(self.hosts, host, created)
            if not full or time.monotonic() > deadline:
                raise SandboxError("no sandbox host could start the sandbox: " + "; ".join(errors))
            await asyncio.sleep(1.0)  # a host is full: wait for room (Retry-After: 1)

    async def _restore(self, body: dict, ref: SnapshotRef) -> RemoteSandbox:
        """On the host holding the snapshot, the only one that can restore it."""
        host = next((h for h in self.hosts.hosts if h.url == ref.host), None)
        if host is None:
            raise SandboxError(f"snapshot {ref.digest[:19]}: its host {ref.host or '(none)'} is none of sandbox.hosts")
        errors: list[str] = []
        created = await self._create_on(
            host, {**body, "snapshot": {"digest": ref.digest, "token": ref.token}}, errors, []
        )
        if created is None:
            raise SandboxError(f"restoring snapshot {ref.digest[:19]}: " + "; ".join(errors))
        host.active += 1
        host.started += 1
        return RemoteSandbox(self.hosts, host, created)

    async def _create_on(self, host: Host, body: dict, errors: list[str], full: list[Host]) -> dict | None:
        """The host's create answer, or None with the reason appended to `errors` (and the host to `full`
        where it was at capacity: the reason's text may hold "429" anyway, in a port or a digest)."""
        try:
            await host.ensure_capacity()
            r = await host.client().post("/v1/sandboxes", json=body)
            missing = _missing_layers(r)
            if missing and self._provide is not None:
                await self._provide(host, missing)
                r = await host.client().post("/v1/sandboxes", json=body)
        except httpx.TransportError as exc:
            host.mark_down()
            errors.append(f"{host.url}: {type(exc).__name__}: {exc}")
            return None
        except SandboxError as exc:
            errors.append(str(exc))
            return None
        if r.status_code == 429:
            errors.append(f"{host.url}: 429 at capacity")
            full.append(host)
            return None
        try:
            check(r, host.url)
        except SandboxError as exc:
            errors.append(str(exc))
            return None
        return r.json()

    async def build(self, spec: SandboxSpec, layer: Path):
        raise SandboxError("the remote backend builds no layers here: its hosts build images (POST /v1/images)")

    def run_python(self, spec: PythonSpec) -> PythonRun:
        if self._make_local is None:
            raise SandboxError(
                "the remote backend runs family generators on this machine's bwrap backend, which is not available here"
            )
        if self._local is None:
            self._local = self._make_local()
        return self._local.run_python(spec)
