"""What a sandbox may reach on the network, per phase: Harbor's network modes, and furlong's `packages`.

Harbor 0.25 names three modes (`harbor.models.task.config.NetworkMode`): `no-network`, `public` and
`allowlist` with `allowed_hosts`. furlong adds `packages`: an allowlist whose hosts are this host's package
indexes (its pip and uv indexes, Debian and Ubuntu mirrors, uv's installer: furlong.sandbox.runtime.indexes), so a
task's tests can install what they need while the rest of the internet stays out of reach.

An allowlist entry is, as Harbor validates and normalises it: a hostname (`example.com`), a leading wildcard
(`*.example.com`: any name under it, not the name itself), an IPv4 or IPv6 address, or a CIDR range; never a
URL, a port or a path. Hostnames are lower-cased and lose a trailing dot. How the modes are enforced:
furlong.sandbox.runtime.netns (routes) and furlong.sandbox.runtime.egress_proxy (the proxy and DNS); docs/sandboxes.md.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

Mode = Literal["no-network", "public", "allowlist", "packages"]
MODES: tuple[Mode, ...] = ("no-network", "public", "allowlist", "packages")
_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")  # Harbor's hostname label rule
BAD_ENTRY = "expected hostnames, IP addresses or CIDR ranges, not URLs, ports or paths"


class HostError(ValueError):
    """An allowlist entry Harbor would refuse; the message names the entry and the rule."""


@dataclass(frozen=True)
class NetworkPolicy:
    """One phase's network. `hosts`: allowlist entries, normalised (normalize_hosts); for `packages`, hosts
    allowed beside the package indexes; empty otherwise."""

    mode: Mode = "no-network"
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"network mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.hosts and self.mode not in ("allowlist", "packages"):
            raise ValueError(f"network mode {self.mode!r} takes no hosts (allowed_hosts is for 'allowlist')")

    @property
    def online(self) -> bool:
        """Whether anything beyond the sandbox's own loopback is reachable."""
        return self.mode != "no-network"

    @property
    def proxied(self) -> bool:
        """Whether it is reached only through the egress proxy (a restricted mode)."""
        return self.mode in ("allowlist", "packages")

    def describe(self) -> str:
        return self.mode + (f" ({', '.join(self.hosts)})" if self.hosts else "")


NO_NETWORK = NetworkPolicy()
PUBLIC = NetworkPolicy("public")
PACKAGES = NetworkPolicy("packages")


def policy(mode: str, hosts: list[str] | tuple[str, ...] = ()) -> NetworkPolicy:
    """A policy from a mode's name and raw allowlist entries (validated and normalised)."""
    if mode not in MODES:
        raise ValueError(f"network mode {mode!r}: expected one of {', '.join(MODES)}")
    return NetworkPolicy(mode, normalize_hosts(hosts))


def normalize_hosts(hosts: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Harbor's validation and normalisation of `allowed_hosts`, duplicates dropped; HostError names the
    first entry that breaks a rule."""
    out: list[str] = []
    for raw in hosts:
        entry = _normalize(raw)
        if entry not in out:
            out.append(entry)
    return tuple(out)


def _normalize(raw: str) -> str:
    host = str(raw).strip().lower().rstrip(".")
    if not host:
        raise HostError(f"entry {raw!r}: empty; {BAD_ENTRY}")
    if "/" in host or ":" in host:  # a CIDR range or an IPv6 address, or a URL, port or path
        try:
            if "/" in host and "%" not in host:
                return ipaddress.ip_network(host, strict=True).compressed
            if "%" not in host and ipaddress.ip_address(host).version == 6:
                return ipaddress.ip_address(host).compressed
        except ValueError:
            pass
        raise HostError(f"entry {raw!r}: {BAD_ENTRY}")
    if "[" in host or "]" in host:
        raise HostError(f"entry {raw!r}: {BAD_ENTRY}")
    name = host
    if host.startswith("*."):
        name = host[2:]
        if _is_address(name):
            raise HostError(f"entry {raw!r}: a wildcard names hostnames, not an IP address")
    elif "*" in host:
        raise HostError(f"entry {raw!r}: a wildcard must be a leading '*.'")
    if not name or not all(_LABEL.match(label) for label in name.split(".")):
        raise HostError(
            f"entry {raw!r}: expected an IP address, a CIDR range, or a hostname (or '*.' and one) "
            "of letters, digits, hyphens and dots"
        )
    return host


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Admission:
    """What a policy's allowlist admits: names (exact, or under a `*.` wildcard) and addresses (literals
    and ranges). It says nothing of the host's own addresses: furlong.sandbox.runtime.egress_proxy refuses those
    whatever a policy says."""

    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # ".example.com" for "*.example.com"
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    everything: bool = False  # public

    @classmethod
    def of(cls, entries: tuple[str, ...], everything: bool = False) -> Admission:
        names, suffixes, networks = set(), [], []
        for entry in entries:
            if entry.startswith("*."):
                suffixes.append(entry[1:])
            elif "/" in entry or _is_address(entry):
                networks.append(ipaddress.ip_network(entry))
            else:
                names.add(entry)
        return cls(frozenset(names), tuple(suffixes), tuple(networks), everything)

    def name(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return self.everything or host in self.names or any(host.endswith(s) for s in self.suffixes)

    def address(self, address: str) -> bool:
        """An address given as a literal (a CONNECT to an IP): only what the list names by address."""
        ip = ipaddress.ip_address(address)
        return self.everything or any(ip.version == n.version and ip in n for n in self.networks)
