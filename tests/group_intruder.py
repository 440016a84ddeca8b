"""A process that joins a weight-update group's store (furlong.sync.broadcast) from outside the run, for
test_sync_broadcast's authentication tests. Prints one JSON line with what happened.

    python tests/group_intruder.py intruder ADDRESS PORT RANK WORLD GROUP
        A stranger who found the store's port: it knows furlong's protocol (the key prefix, the barrier, a
        32-byte MAC all-gather) but not the run's secret. It joins as RANK with raw torch.distributed,
        sends a guessed MAC and then waits for any broadcast from rank 0: {"joined", "received", "error"}.
    python tests/group_intruder.py member ADDRESS PORT RANK WORLD GROUP NONCE SECRET
        A furlong member (WeightGroup) holding SECRET, which may be the wrong one: {"joined", "error"}.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's furlong, as the tests import it

import torch
import torch.distributed as dist

TIMEOUT_S = 20.0


def _intruder(address: str, port: int, rank: int, world: int, group: str) -> dict:
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"furlong/{group}/", store), rank, world, options)
    out: dict = {"joined": False, "received": False, "error": None}
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        pg.broadcast([torch.zeros(1)], opts).wait()  # the members' barrier: now it is in the gloo group
        out["joined"] = True
        guess = [torch.empty(32, dtype=torch.uint8) for _ in range(world)]
        pg.allgather([guess], [torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8)]).wait()
        pg.broadcast([torch.empty(1 << 16, dtype=torch.uint8)], opts).wait()  # what a first bucket would be
        out["received"] = True
    except RuntimeError as e:
        out["error"] = str(e)[:300]
    return out


def _member(address: str, port: int, rank: int, world: int, group: str, nonce: str, secret: str) -> dict:
    from furlong.sync.broadcast import GroupSpec, WeightGroup

    spec = GroupSpec(address, port, rank, world, group, auth_nonce=nonce)
    try:
        WeightGroup(spec, rank, TIMEOUT_S, secret=secret).close()
    except RuntimeError as e:
        return {"joined": False, "error": str(e)}
    return {"joined": True, "error": None}


def main(argv: list[str]) -> int:
    mode, address, port, rank, world, group, *rest = argv
    common = (address, int(port), int(rank), int(world), group)
    result = _intruder(*common) if mode == "intruder" else _member(*common, *rest)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
