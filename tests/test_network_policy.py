"""Network policies without sandboxes: Harbor's allowlist rules (checked against harbor's own code), how
task.toml's tables resolve into each phase's policy, furlong's default for tasks that name no mode, what
`packages` reaches, and the gate's proxy and DNS facing malformed requests (a real gate on loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path

import pytest
from conftest import run
from test_harbor_real import in_harbor

from furlong.build.sandbox import network_default
from furlong.config import ConfigError, load_config
from furlong.sandbox.runtime import dns, egress, netns
from furlong.sandbox.base import ImageRef
from furlong.sandbox.runtime.egress_proxy import EgressProxy
from furlong.sandbox.runtime.indexes import package_hosts
from furlong.sandbox.network import (
    NO_NETWORK,
    PUBLIC,
    Admission,
    HostError,
    NetworkPolicy,
    normalize_hosts,
)
from furlong.sandbox.pool import sandbox_spec
from furlong.tasks.loader import load_task
from furlong.tasks.model import TaskError, TaskNetwork
from furlong.tasks.network import with_default

ENTRIES = ["Example.COM.", "*.Example.com", "192.0.2.1", "2001:DB8:0::1", "10.0.0.0/8", "2001:db8::/32",
           "a-b.c", "https://example.com", "example.com:443", "example.com/path", "*example.com", "*.1.2.3.4",
           "", "10.0.0.1/8", "fe80::1%eth0", "[::1]", "exa_mple.com", "-bad.com", "*."]
HARBOR_NORMALIZE = """
import json, sys
from harbor.models.task.config import normalize_allowed_hosts
out = {}
for entry in json.loads(sys.argv[1]):
    try:
        out[entry] = normalize_allowed_hosts([entry])[0]
    except ValueError:
        out[entry] = None
print(json.dumps(out))
"""


def _ours(entry: str) -> str | None:
    try:
        return normalize_hosts([entry])[0]
    except HostError:
        return None


def test_allowed_hosts_are_validated_and_normalised_as_harbor_does(tmp_path: Path):
    theirs = json.loads(in_harbor(["-c", HARBOR_NORMALIZE, json.dumps(ENTRIES)], [tmp_path], tmp_path).splitlines()[-1])
    assert {entry: _ours(entry) for entry in ENTRIES} == theirs
    assert theirs["Example.COM."] == "example.com" and theirs["https://example.com"] is None  # the list means it
    with pytest.raises(HostError, match=r"entry 'example.com:443': expected hostnames, IP addresses or CIDR"):
        normalize_hosts(["example.com:443"])


def test_a_wildcard_names_what_is_under_it_and_addresses_are_named_by_address():
    allow = Admission.of(normalize_hosts(["*.example.com", "pypi.org", "192.0.2.0/24", "2001:db8::1"]))
    assert [allow.name(h) for h in ("a.example.com", "a.b.example.com", "example.com", "xexample.com",
                                    "PyPI.org.", "files.pypi.org")] == [True, True, False, False, True, False]
    assert [allow.address(a) for a in ("192.0.2.77", "192.0.3.1", "2001:db8::1", "2001:db8::2")] == [
        True, False, True, False]
    assert not Admission.of(("pypi.org",)).address("151.101.0.223")  # a name's address is not the name


def _load(tmp_path: Path, toml: str):
    task = tmp_path / "t"
    (task / "tests").mkdir(parents=True, exist_ok=True)
    (task / "tests" / "test.sh").write_text("true\n")
    (task / "instruction.md").write_text("x")
    (task / "task.toml").write_text(toml)
    return load_task(task)


ALLOW = NetworkPolicy("allowlist", ("pypi.org", "*.debian.org"))


@pytest.mark.parametrize("toml, agent, verifier", [
    ("", None, None),  # no mode named: furlong's default fills both
    ('[environment]\nnetwork_mode = "public"\n', PUBLIC, PUBLIC),
    ("[environment]\nallow_internet = false\n", NO_NETWORK, NO_NETWORK),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["PyPI.org", "*.debian.org"]\n', ALLOW, ALLOW),
    ('[verifier]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org", "*.debian.org"]\n', PUBLIC, ALLOW),
    ('[environment]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "public"\n', NO_NETWORK, PUBLIC),
    ('[environment]\nallow_internet = true\n[agent]\nnetwork_mode = "no-network"\n', NO_NETWORK, PUBLIC),
    ('[environment]\nnetwork_mode = "allowlist"\n', NetworkPolicy("allowlist"), NetworkPolicy("allowlist")),
])
def test_each_phase_resolves_as_harbor_resolves_it(tmp_path: Path, toml: str, agent, verifier):
    assert _load(tmp_path, toml).network == TaskNetwork(agent, verifier)


@pytest.mark.parametrize("toml, problem", [
    ('[environment]\nallowed_hosts = ["pypi.org"]\n', "field 'environment.allowed_hosts': only valid with"),
    ('[agent]\nnetwork_mode = "public"\nallowed_hosts = ["pypi.org"]\n',
     "field 'agent.allowed_hosts': only valid with network_mode = 'allowlist', not 'public'"),
    ('[verifier]\nnetwork_mode = "allowlist"\nallowed_hosts = ["https://pypi.org/simple"]\n',
     "field 'verifier.allowed_hosts': entry 'https://pypi.org/simple': expected hostnames"),
    ('[verifier]\nnetwork_mode = "packages"\n', "field 'verifier.network_mode'"),
])
def test_bad_network_keys_are_one_line_errors_naming_the_field(tmp_path: Path, toml: str, problem: str):
    with pytest.raises(TaskError, match=problem):
        _load(tmp_path, toml)


def test_the_default_fills_only_tasks_that_name_no_mode(tmp_path: Path):
    cfg = load_config(None, ["sandbox.network.verifier=packages", "sandbox.network.package_hosts=[Mirror.Example]",
                             "sandbox.debian_mirror=http://deb.example.org/debian"])
    default = network_default(cfg.sandbox)
    assert default == TaskNetwork(NO_NETWORK, NetworkPolicy("packages", ("mirror.example", "deb.example.org")))
    unnamed, named = _load(tmp_path, ""), _load(tmp_path, '[environment]\nnetwork_mode = "public"\n')
    assert [t.network for t in with_default([unnamed, named], default)] == [default, TaskNetwork(PUBLIC, PUBLIC)]
    harbor = network_default(load_config(None, ["sandbox.network.agent=public", "sandbox.network.verifier=public"]).sandbox)
    assert harbor == TaskNetwork(PUBLIC, PUBLIC)
    with pytest.raises(ConfigError, match="sandbox.network.package_hosts: entry 'https://x.example/'"):
        network_default(load_config(None, ["sandbox.network.package_hosts=[https://x.example/]"]).sandbox)


def test_the_episodes_sandbox_can_switch_and_the_control_runs_starts_with_the_tests_network(tmp_path: Path):
    task = _load(tmp_path, '[agent]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "public"\n')
    image = ImageRef(digest="d", layers=())
    episode, control = sandbox_spec(task, image), sandbox_spec(task, image, control=True)
    assert (episode.network, episode.network_phases) == (NO_NETWORK, (PUBLIC,))
    assert (control.network, control.network_phases) == (PUBLIC, ())


def test_packages_reaches_pypi_the_distributions_and_this_hosts_own_indexes(tmp_path: Path):
    (tmp_path / "pip.conf").write_text("[global]\nindex-url = https://mirror.example/simple\n"
                                       "extra-index-url = file:///opt/wheels https://extra.example/simple\n")
    (tmp_path / "uv").mkdir()
    (tmp_path / "uv" / "uv.toml").write_text('[[index]]\nurl = "https://uv.example/simple"\n')
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list").write_text("deb http://ftp.example.org/debian bookworm main\n# deb http://no.example\n")
    (apt / "sources.list.d" / "x.sources").write_text("Types: deb\nURIs: https://deb822.example/debian\n")
    environ = {"PIP_CONFIG_FILE": str(tmp_path / "pip.conf"), "XDG_CONFIG_HOME": str(tmp_path),
               "HOME": str(tmp_path), "UV_EXTRA_INDEX_URL": "https://env.example/simple"}
    found = package_hosts(environ, apt)
    assert found[:3] == ("pypi.org", "files.pythonhosted.org", "deb.debian.org") and "astral.sh" in found
    assert found[-6:] == ("mirror.example", "extra.example", "env.example", "uv.example", "ftp.example.org",
                          "deb822.example")


def test_a_controlled_sandboxs_environment_names_only_its_proxy(tmp_path: Path):
    lent = egress.Egress(key="k", env=(("https_proxy", "http://corp:3128"), ("SSL_CERT_FILE", "/x"),
                                       ("APT_CONFIG", "/y")), directory=None)
    through = egress.through_proxy(lent, netns.PROXY_URL)
    env = dict(through.env)
    assert env["https_proxy"] == env["HTTP_PROXY"] == netns.PROXY_URL and env["SSL_CERT_FILE"] == "/x"
    assert env["no_proxy"] == "localhost,127.0.0.1,::1" and env["APT_CONFIG"] == f"{egress.MOUNT}/apt.conf"
    apt = (through.directory / "apt.conf").read_text()
    assert f'Acquire::https::Proxy "{netns.PROXY_URL}/";' in apt and "corp" not in apt


def _dns(port: int, data: bytes) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(data, ("127.0.0.1", port))
        return s.recv(4096)


def _query(name: str, qtype: int = dns.A, qid: int = 7) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return dns.HEADER.pack(qid, 0x0100, 1, 0, 0, 0) + labels + struct.pack(">HH", qtype, dns.CLASS_IN)


def _proxy(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        return s.recv(4096)


def test_the_gate_answers_malformed_requests_and_keeps_serving(tmp_path: Path):
    """Garbage, a truncated question, a compression pointer, a reply sent as a query, a bad request line, a
    head over the limit: each is answered (or dropped) and the gate still answers a good query after."""
    async def go():
        gate = await EgressProxy().open(NetworkPolicy("allowlist", ("localhost",)))
        try:
            return await asyncio.to_thread(_ask, gate.tcp_port, gate.udp_port)
        finally:
            await gate.close()

    def _ask(tcp: int, udp: int) -> dict:
        def rcode(reply: bytes) -> int:
            return reply[3] & 0xF

        seen = {"short": None, "reply-as-query": None}
        for name, data in (("short", b"\x00\x01"), ("reply-as-query", dns.HEADER.pack(1, 0x8000, 1, 0, 0, 0))):
            try:
                _dns(udp, data)
            except TimeoutError:
                seen[name] = "dropped"
        seen["truncated"] = rcode(_dns(udp, _query("localhost")[:-3]))
        seen["pointer"] = rcode(_dns(udp, dns.HEADER.pack(2, 0, 1, 0, 0, 0) + b"\xc0\x0c\0\1\0\1"))
        seen["two-questions"] = rcode(_dns(udp, dns.HEADER.pack(3, 0, 2, 0, 0, 0) + _query("localhost")[12:] * 2))
        seen["refused"] = rcode(_dns(udp, _query("example.com")))
        good = _dns(udp, _query("localhost", qid=99))
        seen["good"] = (struct.unpack(">H", good[:2])[0], rcode(good), struct.unpack(">H", good[6:8])[0])
        seen["bad-line"] = _proxy(tcp, b"HELLO\r\n\r\n").split(b"\r\n")[0]
        seen["https-absolute"] = _proxy(tcp, b"GET https://localhost/ HTTP/1.1\r\n\r\n").split(b"\r\n")[0]
        seen["huge-head"] = _proxy(tcp, b"GET http://localhost/ HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n")
        seen["host-itself"] = _proxy(tcp, b"CONNECT localhost:22 HTTP/1.1\r\n\r\n").split(b"\r\n")[0]
        return seen

    seen = run(go())
    assert seen == {"short": "dropped", "reply-as-query": "dropped", "truncated": dns.FORMERR,
                    "pointer": dns.FORMERR, "two-questions": dns.FORMERR, "refused": dns.REFUSED,
                    "good": (99, dns.NOERROR, 1), "bad-line": b"HTTP/1.1 400 Bad Request",
                    "https-absolute": b"HTTP/1.1 400 Bad Request", "huge-head": b"",
                    "host-itself": b"HTTP/1.1 403 Forbidden"}
