"""Seeds derived from several integers (run seed, step, group, sample, turn)."""

from __future__ import annotations

import hashlib


def mix_seed(*parts: int) -> int:
    """A well-spread 31-bit seed: nearby inputs must not give overlapping random streams, as
    `seed + turn` and `seed + sample` would (sample s at turn t+1 = sample s+1 at turn t)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31)
