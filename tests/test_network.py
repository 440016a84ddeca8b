"""Networked sandboxes: the internet yes, the host no. Each probe runs in a real networked sandbox and the
verdict is read on the host (the host's listeners count what reached them)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import run, spec
from network_support import (
    ATTACK,
    BACKGROUND,
    BODY,
    GATE_PROBE,
    serve_allowed,
    verdicts,
)
from tests_support import alive, subtree

from furlong.sandbox.runtime import netns
from furlong.sandbox import network
from furlong.sandbox.base import SandboxError, SandboxSpec


class Listener:
    """A host socket that counts what reaches it, after one control connection from the host itself."""

    def __init__(self, family: int, kind: int, address):
        self.sock = socket.socket(family, kind)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" then means every address
        self.sock.bind(address)
        self.count = 0
        if kind == socket.SOCK_STREAM:
            self.sock.listen(16)
        threading.Thread(target=self._serve, args=(kind,), daemon=True).start()

    def _serve(self, kind: int) -> None:
        while True:
            try:
                if kind == socket.SOCK_STREAM:
                    self.sock.accept()[0].close()
                else:
                    self.sock.recvfrom(512)
            except OSError:
                return
            self.count += 1


PROBE = r"""
import socket, sys
port, name, targets = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
ifname = [n for _, n in socket.if_nameindex() if n != "lo"][0]
def attempt(what, make, dest):
    try:
        s = make()
        s.settimeout(2)
        s.connect(dest) if s.type == socket.SOCK_STREAM else s.sendto(b"x", dest)
        print(what, "CONNECTED" if s.type == socket.SOCK_STREAM else "SENT")
    except OSError as e:
        print(what, "refused", type(e).__name__)
for t in targets:
    fam = socket.AF_INET6 if ":" in t else socket.AF_INET
    host = t + "%" + ifname if t.startswith("fe80:") else t
    dest = socket.getaddrinfo(host, port, fam)[0][4]
    attempt("tcp " + t, lambda: socket.socket(fam, socket.SOCK_STREAM), dest)
    attempt("udp " + t, lambda: socket.socket(fam, socket.SOCK_DGRAM), dest)
attempt("abstract", lambda: socket.socket(socket.AF_UNIX), "\0" + name)
"""


def test_host_loopback_addresses_and_abstract_sockets_are_out_of_reach(backend, base_image):
    tcp = Listener(socket.AF_INET6, socket.SOCK_STREAM, ("::", 0))
    port = tcp.sock.getsockname()[1]
    udp = Listener(socket.AF_INET6, socket.SOCK_DGRAM, ("::", port))
    name = f"furlong-test-{uuid.uuid4().hex[:8]}"
    unix = Listener(socket.AF_UNIX, socket.SOCK_STREAM, "\0" + name)
    targets = ["127.0.0.1", "::1"] + [str(ipaddress.ip_network(a).network_address)
                                      for a in netns.host_local_addresses()]
    # controls: each listener is reachable from the host itself, so a zero below means something
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", port))
    socket.socket(socket.AF_UNIX).connect("\0" + name)
    time.sleep(0.2)
    assert (tcp.count, udp.count, unix.count) == (1, 1, 1)

    async def go():
        box = await backend.create(spec(base_image, network=True))
        try:
            await box.write_file("/tmp/probe.py", PROBE)
            return await box.exec(f"python3 /tmp/probe.py {port} {name} {' '.join(targets)}", timeout_s=60)
        finally:
            await box.close()

    r = run(go())
    time.sleep(0.5)
    assert (tcp.count, udp.count, unix.count) == (1, 1, 1), f"the sandbox reached the host:\n{r.stdout}{r.stderr}"
    assert r.exit_code == 0 and "CONNECTED" not in r.stdout, r
    assert r.stdout.count("refused") + r.stdout.count("SENT") == 2 * len(targets) + 1, r
    for listener in (tcp, udp, unix):
        listener.sock.close()


def test_the_sandbox_has_its_own_loopback_and_names_resolve(backend, base_image):
    server = ("python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1', 8123)); s.listen(); "
              "c=s.accept()[0]; c.sendall(b'inside'); c.close()\" & sleep 0.5; "
              "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 8123), 3).recv(9).decode())\"")
    # the mirror the image was built from: no host name written here
    resolve = ("python3 -c \"import socket; host=open('/etc/apt/sources.list').read().split('://')[1].split('/')[0]; "
               "print('RESOLVED', socket.getaddrinfo(host, 80)[0][4][0])\"")

    async def go():
        box = await backend.create(spec(base_image, network=True))
        try:
            assert (await box.exec(server, timeout_s=20)).stdout == "inside\n"
            r = await box.exec(resolve, timeout_s=20)
            assert "RESOLVED" in r.stdout, r
            assert (await box.exec("cat /etc/resolv.conf")).stdout == netns.RESOLV_CONF
        finally:
            await box.close()

    run(go())


def test_apt_reaches_the_mirror_from_a_networked_sandbox(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image, network=True))
        try:
            return await box.exec("apt-get update", timeout_s=180)
        finally:
            await box.close()

    r = run(go())
    assert r.exit_code == 0 and "Err:" not in r.stdout and "W: " not in r.stderr, r


def test_an_image_build_installs_a_package_with_apt(store, backend, tmp_path: Path):
    env = tmp_path / "environment"
    env.mkdir()
    nonce = uuid.uuid4().hex  # a fresh layer, so the build really runs rather than hitting the cache
    (env / "Dockerfile").write_text(f"FROM debian:bookworm\nENV NONCE={nonce}\n"
                                    "RUN apt-get update && apt-get install -y --no-install-recommends bc\n")

    async def go():
        image = await store.image(env / "Dockerfile", backend)
        box = await backend.create(spec(image))
        try:
            return image, await box.exec("echo 6*7 | bc")
        finally:
            await box.close()

    image, r = run(go())
    shutil.rmtree(store.root / image.digest, ignore_errors=True)  # apt's lists are tens of MB; the view goes at sweep
    assert r.stdout == "42\n", r


def _pastas(pids: set[int]) -> set[int]:
    return {p for p in pids if alive(p) and Path(f"/proc/{p}/comm").read_text().startswith("pass")}


def test_pasta_lives_and_dies_with_its_sandbox(backend, base_image):
    async def go():
        boxes = [await backend.create(spec(base_image, network=True)) for _ in range(3)]
        for box in boxes:
            assert (await box.exec("echo up")).stdout == "up\n"
        trees = [subtree(box._proc.pid) for box in boxes]
        assert all(len(_pastas(tree)) == 1 for tree in trees), "one pasta per networked sandbox"
        for box in boxes:
            await box.close()
        return set().union(*trees)

    processes = run(go())
    time.sleep(0.5)
    assert not {p for p in processes if alive(p)}, "a pasta or sandbox process outlived close()"


def test_start_up_cost_of_the_network_is_small(backend, base_image):
    async def start(network: bool) -> float:
        t = time.perf_counter()
        box = await backend.create(spec(base_image, network=network))
        try:
            await box.exec("true")
        finally:
            await box.close()
        return time.perf_counter() - t

    async def go():
        return [min([await start(net) for _ in range(3)]) for net in (False, True)]

    plain, networked = run(go())
    print(f"start + first command: {plain * 1000:.0f} ms plain, {networked * 1000:.0f} ms networked")
    assert networked < plain + 0.5


def test_missing_pieces_are_one_line_errors(backend, base_image, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pasta on it

    async def go():
        with pytest.raises(SandboxError) as err:
            await backend.create(spec(base_image, network=True))
        return str(err.value)

    assert run(go()) == "networked sandboxes need pasta (apt-get install passt)"
    monkeypatch.undo()
    closed = tmp_path / "tun"
    closed.touch(mode=0o600)
    monkeypatch.setattr(netns, "TUN", closed)
    with pytest.raises(SandboxError, match=r"^networked sandboxes need .*tun readable and writable by uid \d+ "
                                           r"\(mode 0o600; an administrator runs `chmod 0666 "):
        netns.check(backend.host_uid if backend.host_uid != os.geteuid() else 65534)


def test_pasta_options_keep_the_host_closed():
    argv = netns.wrap(["bwrap"], os.geteuid())
    assert argv[0] == shutil.which("pasta")
    for option in ("--no-map-gw", "--config-net", "--foreground"):
        assert option in argv
    for flag in ("-t", "-u", "-T", "-U"):
        assert argv[argv.index(flag) + 1] == "none", f"{flag}: no port forwarding either way"


# Restricted networks: a real egress proxy on host loopback, real sandboxes (furlong.sandbox.runtime.egress_proxy)


@pytest.fixture(scope="module")
def allowed(store, tmp_path_factory):
    served = serve_allowed(tmp_path_factory.mktemp("allowed"), store)
    yield served
    served.close()


def _probe_args(allowed) -> str:
    addresses = [str(ipaddress.ip_network(a).network_address) for a in netns.host_local_addresses()][:3]
    return f"{allowed.http_port} {allowed.https_port} {allowed.service.port} {' '.join(addresses)}"


async def _probed(box, allowed, as_verifier: bool = False) -> dict[str, str]:
    await box.write_file("/tmp/gate_probe.py", GATE_PROBE, as_verifier=as_verifier)
    await box.write_file("/tmp/allowed.pem", allowed.cert.read_bytes(), as_verifier=as_verifier)
    r = await box.exec(f"python3 /tmp/gate_probe.py {_probe_args(allowed)}", timeout_s=120, as_verifier=as_verifier)
    assert r.exit_code == 0, r
    return verdicts(r.stdout)


def test_an_allowlist_reaches_its_hosts_and_nothing_else(allowed, base_image):
    """allowed_hosts through the proxy: the allowed name over HTTP and HTTPS (CONNECT, its certificate
    checked); any other name refused, by the proxy and by DNS; an address literal refused even where it is
    the allowed host's; this host refused even where the list names it ("localhost", its own addresses);
    no route out but the proxy (a direct connect, TCP or UDP, fails at once)."""
    hosts = ["allowed.test", "localhost", *(str(ipaddress.ip_network(a).network_address)
                                            for a in netns.host_local_addresses())]
    policy = network.policy("allowlist", hosts)

    async def go():
        box = await allowed.backend.create(spec(base_image, network=policy))
        try:
            return await _probed(box, allowed), (await box.exec("cat /etc/resolv.conf; echo $https_proxy")).stdout
        finally:
            await box.close()

    seen, setup = run(go())
    assert setup == f"{netns.CONTROLLED_RESOLV_CONF}{netns.PROXY_URL}\n"
    assert (seen.pop("http-allowed"), seen.pop("https-allowed"), seen.pop("dns-allowed")) == (BODY, BODY, "127.0.0.1")
    assert (seen.pop("http-other"), seen.pop("connect-other"), seen.pop("connect-literal-of-allowed")) == (
        "HTTP-403", "HTTP-403", "HTTP-403")
    assert (seen.pop("dns-other"), seen.pop("dns-real-name")) == ("unresolved", "unresolved")
    assert (seen.pop("direct-internet-tcp"), seen.pop("direct-internet-udp")) == ("EACCES", "EACCES")
    assert seen.pop("connect-localhost-service") == "HTTP-403"
    for check, verdict in seen.items():  # this host's own addresses: the proxy refuses, no route reaches
        assert verdict == "HTTP-403" if check.startswith("connect-") else verdict != "CONNECTED", (check, verdict)
    assert allowed.service.count == 0, "a sandbox reached a host service"


def test_the_agent_cannot_change_its_network(allowed, base_image):
    """No rtnetlink change (a rule, a route), no namespace of its own, no way into its gate's host port;
    afterwards the rules still hold. A closed sandbox's gate is gone."""
    policy = network.policy("allowlist", ["allowed.test"])

    async def go():
        box = await allowed.backend.create(spec(base_image, network=policy))
        try:
            gate = box.network.gate.tcp_port
            await box.write_file("/tmp/attack.py", ATTACK)
            r = await box.exec(f"python3 /tmp/attack.py {gate}", timeout_s=60)
            return verdicts(r.stdout), await _probed(box, allowed), gate
        finally:
            await box.close()

    attacks, after, gate = run(go())
    assert attacks == {"del-phase-rule": "EPERM", "add-rule-to-main": "EPERM", "add-default-route": "EPERM",
                       "new-net-namespace": "EPERM", "connect-own-gate": "HTTP-403"}
    assert (after["http-allowed"], after["direct-internet-tcp"], after["http-other"]) == (BODY, "EACCES", "HTTP-403")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", gate), timeout=2)


def _background_entries(log: str, since: float) -> list[tuple[str, str]]:
    rows = [line.split() for line in log.splitlines() if len(line.split()) == 3]
    return [(proxied, direct) for t, proxied, direct in rows if float(t) > since]


def test_the_verifier_phase_gets_its_network_and_the_agents_processes_do_not(allowed, base_image):
    """One sandbox, the agent phase offline, then the verifier phase switched to an allowlist, to public and
    to package indexes only, while a process the agent started keeps trying: it gets none of it (where
    the sandbox has one uid it shares the verifier's, as every process of a container does in Harbor).
    A switch for the whole sandbox then gives the agent's processes the policy too."""
    allow = network.policy("allowlist", ["allowed.test"])
    mirror = socket.getaddrinfo("deb.debian.org", 80, socket.AF_INET)[0][4][0]
    fetch = f"python3 -c \"import urllib.request; print(urllib.request.urlopen('http://allowed.test:{allowed.http_port}/', timeout=10).read().decode())\""
    reach = f"python3 -c \"import socket; socket.create_connection(('{mirror}', 80), 10); print('CONNECTED')\""

    async def go():
        box = await allowed.backend.create(SandboxSpec(base_image, network_phases=(allow, network.PUBLIC,
                                                                                     network.PACKAGES)))
        try:
            await box.write_file("/tmp/bg.py", BACKGROUND)
            await box.exec(f"nohup python3 /tmp/bg.py {allowed.http_port} {mirror} /tmp/bg.log >/dev/null 2>&1 &")
            offline = (await box.exec(fetch, timeout_s=30)).stderr
            await box.set_network(allow, verifier_only=True)
            switched = time.time()  # attempts that began before may have been decided by the offline phase
            seen = {"verifier-allowlist": await box.exec(fetch, timeout_s=30, as_verifier=True),
                    "agent-allowlist": await box.exec(fetch, timeout_s=30)}
            await box.set_network(network.PUBLIC, verifier_only=True)
            seen |= {"verifier-public": await box.exec(reach, timeout_s=30, as_verifier=True),
                     "agent-public": await box.exec(reach, timeout_s=30)}
            await box.set_network(network.PACKAGES, verifier_only=True)
            seen |= {"verifier-packages": await box.exec("apt-get update", timeout_s=180, as_verifier=True),
                     "verifier-packages-other": await box.exec(fetch, timeout_s=30, as_verifier=True)}
            while len(_background_entries((await box.read_file("/tmp/bg.log")).decode(), switched)) < 5:
                await asyncio.sleep(0.2)
            background = _background_entries((await box.read_file("/tmp/bg.log")).decode(), switched)
            await box.set_network(allow)
            seen["agent-after-a-switch-for-all"] = await box.exec(fetch, timeout_s=30)
            return box.verifier_uid, offline, seen, background
        finally:
            await box.close()

    verifier_uid, offline, seen, background = run(go())
    assert "HTTP Error 403" in offline
    assert seen["verifier-allowlist"].stdout == BODY + "\n"
    assert seen["verifier-public"].stdout == "CONNECTED\n"
    apt = seen["verifier-packages"]
    assert apt.exit_code == 0 and "Err:" not in apt.stdout and "W: " not in apt.stderr, apt
    assert "HTTP Error 403" in seen["verifier-packages-other"].stderr  # allowed.test is no package index
    assert seen["agent-after-a-switch-for-all"].stdout == BODY + "\n"
    if verifier_uid is None:  # one uid: the agent's processes are the verifier's, as in a container
        assert seen["agent-allowlist"].stdout == BODY + "\n"
        return
    assert "Permission denied" in seen["agent-allowlist"].stderr
    assert "Permission denied" in seen["agent-public"].stderr
    assert background and all(proxied == "EACCES" and direct == "EACCES" for proxied, direct in background), background


def test_a_sandbox_started_for_one_policy_keeps_it(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            await box.set_network(network.NO_NETWORK)  # the one it has: nothing to do
            with pytest.raises(SandboxError, match="started with network no-network and cannot switch to public"):
                await box.set_network(network.PUBLIC, verifier_only=True)
        finally:
            await box.close()

    run(go())
