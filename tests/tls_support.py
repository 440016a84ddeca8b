"""An HTTPS server whose CA only the test trusts, where a networked sandbox can reach it.

The fence keeps networked sandboxes (and build steps) off every address of the host, so a server on the
host itself is out of reach by design. This one runs in a network namespace of its own (`unshare --net`),
joined to the host by a veth pair: its address is a peer's, not the host's, so pasta's connect() from the
host reaches it through the veth like any outside machine, and the default fence stays as it is. Both
ends go with the server's process (a veth pair dies with its namespace). Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import random
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PORT = 8443
SERVER = r"""
import functools, http.server, ssl, sys
cert, key, root = sys.argv[1:4]
class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
handler = functools.partial(Quiet, directory=root)
server = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[4])), handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
server.socket = context.wrap_socket(server.socket, server_side=True)
print("ready", flush=True)
server.serve_forever()
"""


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca_and_cert(work: Path, address: str) -> tuple[Path, Path, Path]:
    """A fresh CA (ca.pem) and a server certificate it signs for `address` (server.pem, server.key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("furlong test CA")).issuer_name(_name("furlong test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(_name(address)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = work / "ca.pem", work / "server.pem", work / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def _ip(*args: str, netns_pid: int | None = None) -> None:
    prefix = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", "--"] if netns_pid else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, text=True, timeout=10)


class TLSServer:
    """`https://ADDRESS:8443/` serving `root`, in its own network namespace; `ca` is its CA's PEM."""

    def __init__(self, work: Path, root: Path):
        net = random.randrange(0, 1 << 14) * 4  # a /30 of 198.18.0.0/15, the range set aside for tests (RFC 2544)
        self.host_side = str(ipaddress.ip_address("198.18.0.0") + net + 1)
        self.address = str(ipaddress.ip_address("198.18.0.0") + net + 2)
        self.url = f"https://{self.address}:{PORT}"
        self.ca, cert, key = make_ca_and_cert(work, self.address)
        self.veth = "flca" + uuid.uuid4().hex[:8]
        self.proc = subprocess.Popen(["unshare", "--net", "--", sys.executable, "-c", SERVER, str(cert), str(key),
                                      str(root), str(PORT)], stdout=subprocess.PIPE, text=True)
        try:
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the TLS server did not start (exit {self.proc.poll()})")
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", str(self.proc.pid))
            _ip("addr", "add", f"{self.host_side}/30", "dev", self.veth)
            _ip("link", "set", self.veth, "up")
            for args in (("addr", "add", f"{self.address}/30", "dev", "eth0"), ("link", "set", "eth0", "up"),
                         ("link", "set", "lo", "up")):
                _ip(*args, netns_pid=self.proc.pid)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        # normally gone with the namespace already
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, check=False)


def probe_wheel(root: Path) -> None:
    """A PEP 503 index under `root`/simple naming one small wheel, furlong-probe 1.0."""
    name = "furlong_probe-1.0-py3-none-any.whl"
    files = {"furlong_probe/__init__.py": "VERSION = '1.0'\n",
             "furlong_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: furlong-probe\nVersion: 1.0\n",
             "furlong_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: furlong-test\n"
                                                   "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    files["furlong_probe-1.0.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + \
        "furlong_probe-1.0.dist-info/RECORD,,\n"
    (root / "files").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(root / "files" / name, "w") as whl:
        for member, text in files.items():
            whl.writestr(member, text)
    digest = hashlib.sha256((root / "files" / name).read_bytes()).hexdigest()
    (root / "simple" / "furlong-probe").mkdir(parents=True, exist_ok=True)
    (root / "simple" / "furlong-probe" / "index.html").write_text(
        f'<html><body><a href="../../files/{name}#sha256={digest}">{name}</a></body></html>\n')
