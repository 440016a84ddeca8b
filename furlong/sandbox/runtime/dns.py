"""The few DNS messages a restricted sandbox's resolver exchanges (RFC 1035): one question in, an answer of
A or AAAA records, or a refusal, out. furlong.sandbox.runtime.egress_proxy decides which; nothing here resolves."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

A, AAAA, CLASS_IN = 1, 28, 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
HEADER = struct.Struct(">HHHHHH")
UDP_MAX = 512  # a reply without EDNS fits in this
TTL_S = 30


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    name: str  # lower case, no trailing dot
    qtype: int
    qclass: int
    question: bytes  # the question section as sent, echoed in the reply


def parse(data: bytes) -> Query | int | None:
    """The query; or the rcode that answers a malformed one (FORMERR, NOTIMP); or None where there is no
    header to answer (too short, or itself a reply)."""
    if len(data) < HEADER.size:
        return None
    qid, flags, qdcount, _, _, _ = HEADER.unpack_from(data)
    if flags & 0x8000:
        return None
    if (flags >> 11) & 0xF != 0:
        return NOTIMP
    if qdcount != 1:
        return FORMERR
    labels, at = [], HEADER.size
    while True:
        if at >= len(data):
            return FORMERR
        n = data[at]
        at += 1
        if n == 0:
            break
        if n > 63 or at + n > len(data):  # a compression pointer has no place in a lone question
            return FORMERR
        labels.append(data[at : at + n])
        at += n
    if at + 4 > len(data) or sum(len(x) + 1 for x in labels) > 255:
        return FORMERR
    qtype, qclass = struct.unpack_from(">HH", data, at)
    try:
        name = b".".join(labels).decode("ascii").lower()
    except UnicodeDecodeError:
        return FORMERR
    return Query(qid, flags, name, qtype, qclass, data[HEADER.size : at + 4])


def reply(query: Query, rcode: int, addresses: tuple[str, ...] = ()) -> bytes:
    """The answer to `query`: `addresses` as records of its type (as many as fit in UDP_MAX), and `rcode`."""
    family, size = (socket.AF_INET, 4) if query.qtype == A else (socket.AF_INET6, 16)
    room = (UDP_MAX - HEADER.size - len(query.question)) // (12 + size)
    records = [
        b"\xc0\x0c" + struct.pack(">HHIH", query.qtype, CLASS_IN, TTL_S, size) + socket.inet_pton(family, a)
        for a in addresses[: max(room, 0)]
    ]
    flags = 0x8000 | (query.flags & 0x0100) | 0x0080 | rcode  # QR, RD as asked, RA
    return HEADER.pack(query.id, flags, 1, len(records), 0, 0) + query.question + b"".join(records)


def error(data: bytes, rcode: int) -> bytes:
    """A reply of `rcode` to a query too malformed to echo its question."""
    qid, flags = struct.unpack_from(">HH", data)
    return HEADER.pack(qid, 0x8000 | (flags & 0x7900) | 0x0080 | rcode, 0, 0, 0, 0)
