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

A controlled sandbox (a restricted policy, or phases that differ: furlong.sandbox.network) gets two more
things. pasta forwards two fixed ports of the sandbox's loopback, PROXY_PORT (TCP) and DNS_PORT (UDP), to its
Gate's ports on host loopback (furlong.sandbox.runtime.egress_proxy), and its resolv.conf names that DNS port. And
its routing rules carry the phase: `prohibit` at PHASE_PREF leaves no route out but loopback (the proxy is
then the only way out, and a connect to any address literal fails), and in a verifier-only phase the
agent's uids lose the proxy and DNS ports and every route but loopback (AGENT_RULES), while the verifier's
uid skips those rules. The host changes them by entering the sandbox's user and network namespaces
(`apply`); nothing inside holds CAP_NET_ADMIN there, so nothing inside can change them back.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxError

DNS_FORWARD = "169.254.1.1"  # as podman does: link-local, so it never names a real resolver
RESOLV_CONF = f"nameserver {DNS_FORWARD}\n"
# A controlled sandbox's side of its gate, on its own loopback (pasta binds 127.0.0.1 and ::1): a port no
# common server takes (not 80, 443, 3128, 8080...), and DNS's own, as resolv.conf names no port.
PROXY_PORT, DNS_PORT = 41871, 53
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
CONTROLLED_RESOLV_CONF = "nameserver 127.0.0.1\n"
LOCAL_PREF, FENCE_PREF, PHASE_PREF = 15, 16, 20  # rule priorities in a controlled sandbox
AGENT_RULES = (
    f"rule add pref 10 ipproto tcp dport {PROXY_PORT} prohibit",
    f"rule add pref 11 ipproto udp dport {DNS_PORT} prohibit",
    "rule add pref 12 lookup local",
    "rule add pref 13 prohibit",
)
TUN = Path("/dev/net/tun")
PASTA_OPTIONS = (
    "--config-net",
    "--foreground",
    "--quiet",
    "--no-map-gw",
    "-t",
    "none",
    "-u",
    "none",
    "-T",
    "none",
    "-U",
    "none",
    "--dns-forward",
    DNS_FORWARD,
)


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
    return (
        f"networked sandboxes need {TUN} readable and writable by uid {uid} "
        f"(mode {oct(stat.S_IMODE(st.st_mode))}; an administrator runs `chmod 0666 {TUN}`, the udev default)"
    )


def host_local_addresses() -> list[str]:
    """Every destination the host delivers to itself (all routing tables), less loopback."""
    found: list[str] = []
    for family in ("-4", "-6"):
        out = subprocess.run(
            ["ip", "-j", family, "route", "show", "table", "all", "type", "local"],
            capture_output=True,
            text=True,
            timeout=10,
        )
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


def fence_script(addresses: list[str], controlled: tuple[str, ...] | None = None) -> str:
    """Shell run inside pasta's namespace: prohibit rules for the host's addresses (and, `controlled`, the
    local table moved behind the agent's rules, then the phase's rules), then exec bwrap."""
    fence = [] if controlled is None else [f"rule add pref {LOCAL_PREF} lookup local", "rule del pref 0"]
    pref = 1 if controlled is None else FENCE_PREF
    lines = [
        "set -e",
        *batches(
            lambda v: [
                *fence,
                *(
                    f"rule add to {a} prohibit priority {pref}"
                    for a in addresses
                    if ipaddress.ip_network(a).version == v
                ),
                *(controlled or ()),
            ]
        ),
    ]
    lines.append('exec "$@"')
    return "\n".join(lines)


def batches(rules: Callable[[int], list[str]]) -> list[str]:
    """`ip -4/-6 -batch` shell lines of `rules(version)`, for each IP version the kernel has, if any."""
    out = []
    for family, version in (("-4", 4), ("-6", 6)):
        if (version == 4 or Path("/proc/net/if_inet6").exists()) and (lines := rules(version)):
            out.append(f"ip {family} -batch - <<'EOF'\n" + "\n".join(lines) + "\nEOF")
    return out


def wrap(
    argv: list[str], uid: int, in_userns: bool = False, gate: tuple[int, int] | None = None, rules: tuple[str, ...] = ()
) -> list[str]:
    """`argv` (bwrap) run inside a fresh network namespace that pasta connects to the internet; with
    `in_userns` (the launcher already made the sandbox's user namespace) pasta makes no user namespace.
    `gate` (its host TCP and UDP ports): a controlled sandbox, whose phase starts with `rules`."""
    check(uid)
    pasta = shutil.which("pasta") or "pasta"
    options = PASTA_OPTIONS if gate is None else controlled_options(*gate)
    script = fence_script(host_local_addresses(), None if gate is None else rules)
    return [
        pasta,
        *options,
        *(["--netns-only"] if in_userns else []),
        "--",
        "/bin/sh",
        "-c",
        script,
        "furlong-netns",
        *argv,
    ]


def controlled_options(tcp_port: int, udp_port: int) -> tuple[str, ...]:
    """pasta's options for a controlled sandbox: its only forwards are its proxy and DNS ports, each to
    its Gate on host loopback; no DNS forward to the host's resolver."""
    return (
        "--config-net",
        "--foreground",
        "--quiet",
        "--no-map-gw",
        "-t",
        "none",
        "-u",
        "none",
        "-T",
        f"{PROXY_PORT}:{tcp_port}",
        "-U",
        f"{DNS_PORT}:{udp_port}",
    )


def phase_rules(restricted: bool, agent_cut: bool, verifier_uid: int | None) -> tuple[str, ...]:
    """A controlled sandbox's phase as routing rules (for `ip rule`, each IP version): `restricted`, no route
    out but loopback; `agent_cut` (a verifier-only phase), the agent's uids keep loopback only, and the
    verifier's uid skips to the rules everyone has."""
    rules: list[str] = []
    if agent_cut and verifier_uid is not None:
        rules += [f"rule add pref 9 uidrange {verifier_uid}-{verifier_uid} goto {LOCAL_PREF}", *AGENT_RULES]
    if restricted:
        rules.append(f"rule add pref {PHASE_PREF} prohibit")
    return tuple(rules)


def switch_script(old: tuple[str, ...], new: tuple[str, ...]) -> str:
    """Shell that moves a controlled sandbox from rules `old` to `new`: the new ones first, then the old
    ones taken away, so no moment has fewer restrictions than both."""
    steps = [r for r in new if r not in old] + [r.replace("rule add", "rule del", 1) for r in old if r not in new]
    return "\n".join(["set -e", *batches(lambda v: list(steps))])


def apply(pid: int, script: str, timeout_s: float = 10.0) -> None:
    """Runs `script` (switch_script) in the user and network namespaces of process `pid` (a controlled
    sandbox's bwrap: its user namespace owns its network namespace), from the host."""
    nsenter = shutil.which("nsenter") or "nsenter"
    proc = subprocess.run(
        [nsenter, f"--user=/proc/{pid}/ns/user", f"--net=/proc/{pid}/ns/net", "--", "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise SandboxError(f"changing the sandbox's network failed: {proc.stderr.strip()[-300:]}")


def resolv_conf(controlled: bool = False) -> Path:
    """A resolv.conf naming pasta's DNS forward address (`controlled`: the gate's DNS port on the sandbox's
    loopback), in a place the sandbox uid can read."""
    base = Path("/run/furlong") if os.geteuid() == 0 else cache_dir()  # root's home is closed to that uid
    path = base / ("gate-resolv.conf" if controlled else "pasta-resolv.conf")
    text = CONTROLLED_RESOLV_CONF if controlled else RESOLV_CONF
    try:
        if path.read_text() == text:
            return path
    except OSError:
        pass
    base.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.rename(path)  # atomic: a sandbox starting meanwhile sees the old file or the new, never half
    return path


@contextmanager
def joined(uid: int, timeout_s: float = 10.0) -> Iterator[list[str]]:
    """As root: an argv prefix (`nsenter --net=...`) that runs a host command inside a fresh pasta network
    namespace, fenced like a networked sandbox's, for tools that bring no namespace of their own (buildah's
    chroot isolation runs RUN steps in its caller's network namespace). The namespace lives as long as
    the block: a holder process sleeps in it, as the sandbox uid."""
    holder = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *wrap(["/bin/sleep", "infinity"], uid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
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
