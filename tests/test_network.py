"""Networked sandboxes: the internet yes, the host no. Each probe runs in a real networked sandbox and the
verdict is read on the host (the host's listeners count what reached them)."""

from __future__ import annotations

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
from tests_support import alive, subtree

from furlong.sandbox import netns
from furlong.sandbox.base import SandboxError


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
