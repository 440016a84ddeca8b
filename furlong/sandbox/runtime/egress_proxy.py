"""The way out of a restricted sandbox: an HTTP proxy and a DNS responder on host loopback, one Gate each.

A sandbox whose network is restricted (furlong.sandbox.network: `allowlist`, `packages`, or phases that
differ) has no route out of its network namespace (furlong.sandbox.runtime.netns); pasta forwards two fixed ports
of the sandbox's loopback to its Gate's ports here, and nothing else. The Gate admits what its current
policy does:
- the proxy takes `CONNECT host:port` (HTTPS, any TCP) and absolute-form plain HTTP (`GET http://host/...`,
  sent on with `Connection: close`); a name must be on the list, an address literal must be named by
  address or range (so an allowed name's address gives nothing), and whatever it names, the proxy resolves
  it itself and connects to the address it checked, never to this host's own addresses (loopback, every
  local address of the host, link-local ones such as a cloud's metadata service);
- the DNS responder answers A and AAAA questions for names on the list (from the same resolver),
  REFUSED for any other name, so names cannot carry data out through the host's resolver.
A policy change cuts the connections made under the one before. One thread serves every Gate of a
process (its own event loop), so a sandbox's downloads never stall the caller's loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from furlong.sandbox.network import NO_NETWORK, Admission, NetworkPolicy
from furlong.sandbox.runtime import dns
from furlong.sandbox.runtime.indexes import package_hosts
from furlong.sandbox.runtime.netns import host_local_addresses

log = logging.getLogger(__name__)
HEAD_MAX = 64 << 10  # a request's head (line and headers)
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 15.0
LOCAL_REFRESH_S = 30.0  # how long the host's own addresses are cached
HOP_HEADERS = ("proxy-connection", "proxy-authorization", "connection", "keep-alive")
Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, family: 0 for both) -> addresses


@dataclass(frozen=True)
class TestOnlyNames:
    """TEST-ONLY wiring, never built from config: names resolved to (address, port) of a test's own server,
    and that one address and port let through the refusal of this host's own addresses, so a test can
    stand up an allowed host on loopback. Names not here resolve as usual."""

    entries: tuple[tuple[str, str, int], ...]  # (name, address, port)

    def resolve(self, name: str, family: int) -> list[str] | None:
        found = [a for n, a, _ in self.entries if n == name]
        if not found:
            return None
        return [a for a in found if family == 0 or _family(a) == family]

    def exempt(self, address: str, port: int) -> bool:
        return any(a == address and p == port for _, a, p in self.entries)


def _family(address: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET


async def system_resolver(name: str, family: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, family=family, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Refused(Exception):
    """A destination the policy does not admit (403), or that cannot be reached (502)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class Gate:
    """One sandbox's proxy (TCP) and DNS (UDP) ports on host loopback, and the policy they apply now."""

    def __init__(self, proxy: EgressProxy, policy: NetworkPolicy):
        self.proxy, self.policy = proxy, policy
        self.admission = proxy.admission(policy)
        self.tcp_port = self.udp_port = 0
        self._server: asyncio.AbstractServer | None = None
        self._dns: asyncio.DatagramTransport | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0, limit=HEAD_MAX)
        self.tcp_port = self._server.sockets[0].getsockname()[1]
        self._dns, _ = await loop.create_datagram_endpoint(lambda: _Dns(self), local_addr=("127.0.0.1", 0))
        self.udp_port = self._dns.get_extra_info("sockname")[1]

    async def set(self, policy: NetworkPolicy) -> None:
        """From now on `policy` (from any event loop); connections made before are cut if it changed."""
        await self.proxy.call(self._set(policy))

    async def _set(self, policy: NetworkPolicy) -> None:
        if policy != self.policy:
            self.policy, self.admission = policy, self.proxy.admission(policy)
            self._cut()

    async def close(self) -> None:
        await self.proxy.call(self._close())

    async def _close(self) -> None:
        self.policy, self.admission = NO_NETWORK, Admission()
        if self._server is not None:
            self._server.close()
        if self._dns is not None:
            self._dns.close()
        self._cut()

    def _cut(self) -> None:
        for writer in list(self._conns):
            writer.transport.abort()
        self._conns.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            request = _Request.parse(head)
            admission = self.admission
            addresses = await self.proxy.destinations(request.host, request.port, admission)
            up_reader, upstream = await _connect(addresses, request.port)
            if admission is not self.admission:  # the phase changed meanwhile: decided under the old policy
                raise Refused(403, "the sandbox's network policy changed")
            self._conns.add(upstream)
            if request.method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.write(request.forwarded())
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except Refused as exc:
            log.debug("egress refused: %s", exc)
            _answer(writer, exc.status, str(exc))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, OSError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._conns.discard(w)
                    w.close()


@dataclass(frozen=True)
class _Request:
    method: str
    host: str
    port: int
    target: str  # origin-form, for plain HTTP
    version: str
    headers: tuple[str, ...]

    @classmethod
    def parse(cls, head: bytes) -> _Request:
        line, *headers = head.decode("latin-1").split("\r\n")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise Refused(400, "expected a proxy request line: METHOD TARGET HTTP/1.x")
        method, target, version = parts
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise Refused(400, f"CONNECT {target}: expected host:port")
            return cls(method, host.lower(), int(port), "", version, ())
        url = urlsplit(target)
        try:
            url_port = url.port or 80
        except ValueError:
            raise Refused(400, f"{target}: bad port") from None
        if url.scheme != "http" or not url.hostname:
            raise Refused(400, f"{method} {target}: expected an absolute http:// URL (https goes through CONNECT)")
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        kept = tuple(h for h in headers if h and h.split(":", 1)[0].strip().lower() not in HOP_HEADERS)
        return cls(method, url.hostname.lower(), url_port, path, version, kept)

    def forwarded(self) -> bytes:
        """The request as its origin takes it: origin-form, no proxy headers, one request per connection."""
        lines = [f"{self.method} {self.target} {self.version}", *self.headers, "Connection: close", "", ""]
        return "\r\n".join(lines).encode("latin-1")


def _answer(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    words = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
    body = f"furlong egress proxy: {reason}\n".encode()
    writer.write(
        f"HTTP/1.1 {status} {words}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n".encode()
        + body
    )


async def _connect(addresses: list[str], port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    last = ""
    for address in addresses:
        try:
            return await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            last = f"{address} port {port}: {exc or type(exc).__name__}"
    raise Refused(502, f"cannot connect to {last}")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


class _Dns(asyncio.DatagramProtocol):
    def __init__(self, gate: Gate):
        self.gate = gate
        self.transport: asyncio.DatagramTransport | None = None
        self._pending: set[asyncio.Task] = set()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _answer(self, data: bytes, addr) -> None:
        query = dns.parse(data)
        if query is None:
            return
        if isinstance(query, int):
            out = dns.error(data, query)
        else:
            out = await self.gate.proxy.answer(query, self.gate.admission)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(out, addr)


class EgressProxy:
    """Every Gate of this process, served by one thread of its own. `package_hosts`: what `packages` admits
    (furlong.sandbox.runtime.indexes, read on first need); `test_only`: see TestOnlyNames."""

    def __init__(
        self,
        package_hosts: Callable[[], tuple[str, ...]] | None = None,
        test_only: TestOnlyNames | None = None,
        resolver: Resolver = system_resolver,
    ):
        self._package_source = package_hosts
        self._packages: tuple[str, ...] | None = None
        self.test_only, self._resolver = test_only, resolver
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._local: tuple[float, list[Any]] = (0.0, [])

    def _thread_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="furlong-egress", daemon=True).start()
                self._loop = loop
            return self._loop

    async def call(self, coro: Coroutine) -> Any:
        """Runs `coro` on the proxy's loop, awaited from the caller's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._thread_loop()))

    async def open(self, policy: NetworkPolicy) -> Gate:
        gate = Gate(self, policy)
        await self.call(gate._start())
        return gate

    def admission(self, policy: NetworkPolicy) -> Admission:
        if policy.mode == "public":
            return Admission(everything=True)
        if policy.mode == "packages":
            if self._packages is None:
                self._packages = (self._package_source or package_hosts)()
            return Admission.of((*self._packages, *policy.hosts))
        return Admission.of(policy.hosts)

    async def destinations(self, host: str, port: int, admission: Admission) -> list[str]:
        """The addresses to connect to for `host`, checked; Refused(403) saying why there are none."""
        literal = _literal(host)
        if literal is not None:
            if not admission.address(literal):
                raise Refused(403, f"{host}: an address this sandbox's network policy does not name")
            found = [literal]
        elif not admission.name(host):
            raise Refused(403, f"{host}: a name this sandbox's network policy does not admit")
        else:
            try:
                found = await self.resolve(host, 0)
            except OSError as exc:
                raise Refused(502, f"cannot resolve {host}: {exc}") from None
        kept = [a for a in found if not await self._own(a, port)]
        if not kept:
            raise Refused(403, f"{host}: this host itself (loopback, a local or link-local address)")
        return kept

    async def resolve(self, name: str, family: int) -> list[str]:
        if self.test_only is not None and (found := self.test_only.resolve(name, family)) is not None:
            return found
        return await self._resolver(name, family)

    async def _own(self, address: str, port: int) -> bool:
        """Whether `address` is this host's (or link-local: a metadata service), unless test-only wiring
        lets this address and port through."""
        if self.test_only is not None and self.test_only.exempt(address, port):
            return False
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
            return True
        return any(ip.version == net.version and ip in net for net in await self._local_networks())

    async def _local_networks(self) -> list[Any]:
        at, nets = self._local
        if time.monotonic() - at > LOCAL_REFRESH_S:
            found = await asyncio.to_thread(host_local_addresses)
            nets = [ipaddress.ip_network(a, strict=False) for a in found]
            self._local = (time.monotonic(), nets)
        return nets

    async def answer(self, query: dns.Query, admission: Admission) -> bytes:
        if query.qclass != dns.CLASS_IN or not admission.name(query.name) or _literal(query.name) is not None:
            return dns.reply(query, dns.REFUSED)
        if query.qtype not in (dns.A, dns.AAAA):
            return dns.reply(query, dns.NOERROR)  # the name exists for this sandbox; no records of this type
        family = socket.AF_INET if query.qtype == dns.A else socket.AF_INET6
        try:
            found = await self.resolve(query.name, family)
        except socket.gaierror as exc:
            nodata = exc.errno in (socket.EAI_NODATA, getattr(socket, "EAI_ADDRFAMILY", -9))
            return dns.reply(
                query, dns.NOERROR if nodata else dns.NXDOMAIN if exc.errno == socket.EAI_NONAME else dns.SERVFAIL
            )
        except OSError:
            return dns.reply(query, dns.SERVFAIL)
        return dns.reply(query, dns.NOERROR, tuple(a for a in found if _family(a) == family))


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None
