"""Seeds derived from several integers (run seed, step, group, sample, turn)."""

from __future__ import annotations

import hashlib


def mix_seed(*parts: int) -> int:
    """A well-spread 31-bit seed: nearby inputs must not give overlapping random streams, as
    `seed + turn` and `seed + sample` would (sample s at turn t+1 = sample s+1 at turn t)."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31)


def task_seed_key(task_id: str) -> int:
    """A stable integer for a task id (Python's hash() of a str changes between processes)."""
    return int.from_bytes(hashlib.blake2b(task_id.encode(), digest_size=8).digest(), "little")


def eval_seed(seed: int, task_id: str, sample: int) -> int:
    """An eval episode's sampling seed, for training's held-out eval and `furlong eval` alike: of the eval
    seed, the task's id and the sample only, so a task's episodes do not depend on the suite around it."""
    return mix_seed(seed, task_seed_key(task_id), sample)
