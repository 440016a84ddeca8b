"""What the network tests share: an "allowed host" served on host loopback (plain HTTP and HTTPS, with a
certificate made for its name), a backend whose egress proxy resolves that name there (TEST-ONLY wiring:
furlong.sandbox.runtime.egress_proxy.TestOnlyNames), a host service that no sandbox may reach, and the probe a
sandbox runs."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.egress_proxy import EgressProxy, TestOnlyNames

NAME = "allowed.test"  # resolved by the proxy's test-only wiring alone: no real resolver knows it
BODY = "served to the allowed"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        data = BODY.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class Counter:
    """A host TCP service on every address that counts the connections it accepts (none may come from a
    sandbox)."""

    def __init__(self):
        self.sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        self.port, self.count = self.sock.getsockname()[1], 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.sock.accept()[0].close()
            except OSError:
                return
            self.count += 1


@dataclass
class Allowed:
    """The allowed host's servers, the CA file (its self-signed certificate) and the backend that reaches it."""

    http_port: int
    https_port: int
    cert: Path
    backend: BwrapBackend
    service: Counter
    servers: tuple[ThreadingHTTPServer, ...]

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        self.service.sock.close()


def serve_allowed(tmp: Path, store) -> Allowed:
    cert, key = tmp / "allowed.pem", tmp / "allowed.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    f"/CN={NAME}", "-addext", f"subjectAltName=DNS:{NAME}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    plain = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    tls = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    tls.socket = context.wrap_socket(tls.socket, server_side=True)
    for server in (plain, tls):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    ports = plain.server_address[1], tls.server_address[1]
    wiring = TestOnlyNames(tuple((NAME, "127.0.0.1", port) for port in ports))
    backend = BwrapBackend(layers=store, proxy=EgressProxy(test_only=wiring))
    return Allowed(ports[0], ports[1], cert, backend, Counter(), (plain, tls))


# Run in a sandbox as `python3 /tmp/gate_probe.py HTTP_PORT HTTPS_PORT HOST_SERVICE_PORT HOST_ADDRESS...`: one line
# per check, "<check> <verdict>", the verdict what a user would see (a body, a status, an errno).
GATE_PROBE = r"""
import errno, os, socket, ssl, sys, urllib.error, urllib.request
http, https, service, addresses = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
def get(url, context=None):
    try:
        return urllib.request.urlopen(url, timeout=10, context=context).read().decode()
    except urllib.error.HTTPError as e:
        return f"HTTP-{e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return errno.errorcode.get(getattr(reason, "errno", None) or 0, type(reason).__name__)
def connect(target):
    try:
        s = socket.create_connection(("127.0.0.1", 41871), 10)
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        return "HTTP-" + s.recv(200).split(b" ")[1].decode()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, type(e).__name__)
def direct(host, port, kind=socket.SOCK_STREAM):
    try:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind)
        s.settimeout(5)
        s.connect((host, port)) if kind == socket.SOCK_STREAM else s.sendto(b"x", (host, port))
        return "CONNECTED"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, type(e).__name__)
def resolve(name):
    try:
        return "/".join(sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)}))
    except socket.gaierror as e:
        return "unresolved"
tls = ssl.create_default_context(cafile="/tmp/allowed.pem")
print("http-allowed", get(f"http://allowed.test:{http}/"))
print("https-allowed", get(f"https://allowed.test:{https}/", tls))
print("http-other", get(f"http://other.test:{http}/"))
print("connect-other", connect(f"other.test:{https}"))
print("connect-literal-of-allowed", connect(f"127.0.0.1:{https}"))
print("connect-localhost-service", connect(f"localhost:{service}"))
for a in addresses:
    print(f"connect-host-address-{a}", connect(f"{'[' + a + ']' if ':' in a else a}:{service}"))
    print(f"direct-host-address-{a}", direct(a, service))
print("direct-internet-tcp", direct("198.51.100.7", 80))
print("direct-internet-udp", direct("198.51.100.7", 53, socket.SOCK_DGRAM))
print("dns-allowed", resolve("allowed.test"))
print("dns-other", resolve("other.test"))
print("dns-real-name", resolve("deb.debian.org"))
"""


def verdicts(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


# The agent's attempts on its own sandbox's network, as a sandbox runs them: `python3 /tmp/attack.py GATE_PORT`.
# Every rtnetlink change needs CAP_NET_ADMIN over the sandbox's network namespace, which nothing inside has.
ATTACK = r"""
import ctypes, errno, socket, struct, sys
def netlink(kind, body, flags=0x1 | 0x4):
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    s.bind((0, 0))
    s.send(struct.pack("=IHHII", 16 + len(body), kind, flags, 1, 0) + body)
    code = struct.unpack_from("=i", s.recv(4096), 16)[0]
    return errno.errorcode.get(-code, "OK") if code else "OK"
def attr(kind, value):
    return struct.pack("=HHI", 8, kind, value)
rule = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, 254, 0, 0, 1, 0)  # lookup main
print("del-phase-rule", netlink(33, struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, 0, 0, 0, 8, 0) + attr(6, 20)))
print("add-rule-to-main", netlink(32, rule + attr(6, 1), 0x1 | 0x4 | 0x400 | 0x200))
route = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, 254, 3, 0, 1, 0)  # a default route in main
print("add-default-route", netlink(24, route + attr(4, socket.if_nametoindex([n for _, n in socket.if_nameindex() if n != "lo"][0])), 0x1 | 0x4 | 0x400))
libc = ctypes.CDLL(None, use_errno=True)
print("new-net-namespace", "OK" if libc.unshare(0x40000000) == 0 else errno.errorcode[ctypes.get_errno()])
try:
    s = socket.create_connection(("127.0.0.1", 41871), 10)
    s.sendall(f"CONNECT 127.0.0.1:{sys.argv[1]} HTTP/1.1\r\n\r\n".encode())
    print("connect-own-gate", "HTTP-" + s.recv(200).split(b" ")[1].decode())
except OSError as e:
    print("connect-own-gate", errno.errorcode.get(e.errno or 0))
"""

# An agent's process left running into the verifier phase: `python3 /tmp/bg.py HTTP_PORT ADDRESS LOG` appends
# "<time its attempts began> <through the proxy> <direct to ADDRESS:80>" to LOG every 0.1 s.
BACKGROUND = r"""
import errno, socket, sys, time, urllib.error, urllib.request
port, address, log = sys.argv[1], sys.argv[2], sys.argv[3]
def verdict(call):
    try:
        return call()
    except urllib.error.HTTPError as e:
        return f"HTTP-{e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return errno.errorcode.get(getattr(reason, "errno", None) or 0, type(reason).__name__)
while True:
    began = time.time()
    proxied = verdict(lambda: urllib.request.urlopen(f"http://allowed.test:{port}/", timeout=2).read().decode())
    direct = verdict(lambda: socket.create_connection((address, 80), 2) and "CONNECTED")
    with open(log, "a") as f:
        f.write(f"{began} {proxied.replace(' ', '_')} {direct}\n")
    time.sleep(0.1)
"""
