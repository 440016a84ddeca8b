"""Networked sandboxes: a network namespace of their own, connected outward by pasta (user-mode networking).

Sharing the host's network namespace would hand a task every service on host loopback (the engine
server, the weight update server) and the host's abstract unix sockets. Instead pasta (Debian package
passt) creates a user + network namespace, runs bwrap inside it (bwrap then shares that namespace,
not the host's), and relays the namespace's TCP and UDP through ordinary sockets of its own.

What a sandbox could still reach, and what closes it:
- 127.0.0.1 and ::1 are the namespace's own loopback, so host loopback is out of sight.
- `--no-map-gw`: the gateway address is the real gateway, not an alias for host loopback.
- `-t/-u/-T/-U none`: no port is forwarded in either direction.
- Any other address of the host (another interface's, an IPv6 link-local one) would still be a
  connect() on the host by pasta, so each gets a `prohibit` policy rule in the namespace before bwrap
  starts. The sandbox runs in bwrap's nested user namespace without capabilities and cannot undo them.
- DNS: the namespace's resolv.conf names a fixed address whose UDP port 53 pasta relays to the first
  resolver in the host's /etc/resolv.conf, a loopback one (systemd-resolved's stub) included. That one
  port of that one address is the only way to host loopback. (This pasta's own `-D` option is broken.)
pasta runs as the sandbox uid in the foreground as the sandbox's launcher process, so it lives and dies
with the sandbox (and sits in its cgroup when there is one).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxError

DNS_FORWARD = "169.254.1.1"  # as podman does: link-local, so it never names a real resolver
RESOLV_CONF = f"nameserver {DNS_FORWARD}\n"
TUN = Path("/dev/net/tun")
PASTA_OPTIONS = ("--config-net", "--foreground", "--quiet", "--no-map-gw",
                 "-t", "none", "-u", "none", "-T", "none", "-U", "none", "--dns-forward", DNS_FORWARD)


def _tun_problem(uid: int) -> str | None:
    # pasta opens the tun device as the sandbox uid from inside its namespace; Debian's udev makes it
    # 0666 (creating an interface still needs CAP_NET_ADMIN in the namespace), some containers do not.
    try:
        st = TUN.stat()
    except OSError:
        return f"networked sandboxes need {TUN} (modprobe tun)"
    bits = (st.st_mode >> 6) & 0o7 if st.st_uid == uid else st.st_mode & 0o7
    if uid == 0 or bits & 0o6 == 0o6:
        return None
    return (f"networked sandboxes need {TUN} readable and writable by uid {uid} "
            f"(mode {oct(stat.S_IMODE(st.st_mode))}; an administrator runs `chmod 0666 {TUN}`, the udev default)")


def host_local_addresses() -> list[str]:
    """Every destination the host delivers to itself (all routing tables), less loopback."""
    found: list[str] = []
    for family in ("-4", "-6"):
        out = subprocess.run(["ip", "-j", family, "route", "show", "table", "all", "type", "local"],
                             capture_output=True, text=True, timeout=10)
        for route in json.loads(out.stdout or "[]"):
            net = ipaddress.ip_network(route["dst"], strict=False)  # also checks it is an address
            if not net.is_loopback and str(net) not in found:
                found.append(str(net))
    return found


def check(uid: int) -> None:
    """Raises SandboxError naming what networked sandboxes lack here, and its fix."""
    if not shutil.which("pasta"):
        raise SandboxError("networked sandboxes need pasta (apt-get install passt)")
    if not shutil.which("ip"):
        raise SandboxError("networked sandboxes need ip (apt-get install iproute2)")
    if problem := _tun_problem(uid):
        raise SandboxError(problem)


def fence_script(addresses: list[str]) -> str:
    """Shell run inside pasta's namespace: prohibit rules for the host's addresses, then exec bwrap."""
    lines = ["set -e"]
    for family, version in (("-4", 4), ("-6", 6)):
        rules = [f"rule add to {a} prohibit priority 1" for a in addresses
                 if ipaddress.ip_network(a).version == version]
        if rules:
            lines.append(f"ip {family} -batch - <<'EOF'\n" + "\n".join(rules) + "\nEOF")
    lines.append('exec "$@"')
    return "\n".join(lines)


def wrap(argv: list[str], uid: int, in_userns: bool = False) -> list[str]:
    """`argv` (bwrap) run inside a fresh network namespace that pasta connects to the internet; with
    `in_userns` (the launcher already made the sandbox's user namespace) pasta makes no user namespace."""
    check(uid)
    pasta = shutil.which("pasta") or "pasta"
    return [pasta, *PASTA_OPTIONS, *(["--netns-only"] if in_userns else []), "--", "/bin/sh", "-c", fence_script(host_local_addresses()),
            "furlong-netns", *argv]


def resolv_conf() -> Path:
    """A resolv.conf naming pasta's DNS forward address, in a place the sandbox uid can read."""
    base = Path("/run/furlong") if os.geteuid() == 0 else cache_dir()  # root's home is closed to that uid
    path = base / "pasta-resolv.conf"
    try:
        if path.read_text() == RESOLV_CONF:
            return path
    except OSError:
        pass
    base.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(RESOLV_CONF)
    tmp.chmod(0o644)
    tmp.rename(path)  # atomic: a sandbox starting meanwhile sees the old file or the new, never half
    return path


@contextmanager
def joined(uid: int, timeout_s: float = 10.0) -> Iterator[list[str]]:
    """As root: an argv prefix (`nsenter --net=...`) that runs a host command inside a fresh pasta network
    namespace, fenced like a networked sandbox's, for tools that bring no namespace of their own (buildah's
    chroot isolation runs RUN steps in its caller's network namespace). The namespace lives as long as
    the block: a holder process sleeps in it, as the sandbox uid."""
    holder = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                               *wrap(["/bin/sleep", "infinity"], uid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        pid = _sleeper(holder, timeout_s)
        yield ["nsenter", f"--net=/proc/{pid}/ns/net", "--"]
    finally:
        _end(holder)


def _end(holder: subprocess.Popen) -> None:
    """Kills pasta's child before pasta: killed first, pasta would leave it running, reparented to init
    (a `sleep infinity` per build). pasta, still its parent, has not reaped it, so its pid is still it;
    pasta then exits on its own once its child is gone."""
    for child in _children(holder.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        holder.wait(timeout=5)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _sleeper(holder: subprocess.Popen, timeout_s: float) -> int:
    """The pid of pasta's child once it is `sleep`: the fence rules are then in place."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            err = holder.stderr.read().decode(errors="replace").strip()[-300:] if holder.stderr else ""
            raise SandboxError(f"pasta exited before its network namespace was ready: {err}")
        for child in _children(holder.pid):
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "sleep":
                    return child
            except OSError:
                pass
        time.sleep(0.005)
    raise SandboxError(f"pasta's network namespace was not ready within {timeout_s:g}s")
