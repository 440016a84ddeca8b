"""What a big host mount table costs every sandbox start.

Each sandbox is a new mount namespace, and the kernel copies the launching process's whole mount table
into it (and tears the copy down at exit). Until the image store viewed all its layers through one
id-mapped mount, it attached one per layer, never detached within a boot: a host that had run many tasks
held thousands of them. This bench starts sandboxes (create, first command, close; one at a time) from a
private mount namespace holding K extra bind mounts, for each K, so the host's own table is untouched.
Root only (as a user, layers are not mounted at all). Writes bench/results/mount_table.json.

    python bench/mount_table.py                      # K = 0, 1000, 5000; about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import finish, provenance

from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.pool import start_sandbox

RESULTS = Path(__file__).parent / "results" / "mount_table.json"
_MS_BIND = 4096


def add_mounts(k: int, work: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    source = work / "src"
    source.mkdir()
    for i in range(k):
        target = work / str(i)
        target.mkdir()
        if libc.mount(str(source).encode(), str(target).encode(), None, _MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), f"bind mount {i}")


async def starts(n: int) -> list[float]:
    store = ImageStore()
    backend = BwrapBackend(layers=store)
    image = store.base()
    out = []
    for _ in range(n + 1):  # the first one warms caches and is not counted
        t = time.perf_counter()
        box = await start_sandbox(backend, SandboxSpec(image=image))
        await box.close()
        out.append(time.perf_counter() - t)
    return out[1:]


def child(k: int, n: int, work: Path) -> None:
    """In its own mount namespace: the mounts go with it; the parent removes the directories."""
    add_mounts(k, work)
    mounts = len(Path("/proc/self/mountinfo").read_text().splitlines())
    print(json.dumps({"extra_mounts": k, "mounts": mounts, "seconds": asyncio.run(starts(n))}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mounts", type=int, nargs="+", default=[0, 1000, 5000])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.samples, args.work)
    if os.geteuid() != 0:
        sys.exit("bench/mount_table.py: root only (as a user, image layers are not mounted)")
    prov = provenance()
    rows = []
    for k in args.mounts:
        with tempfile.TemporaryDirectory() as work:
            res = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, __file__,
                                  "--child", str(k), "--samples", str(args.samples), "--work", work],
                                 capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"the measurement with {k} extra mounts failed:\n{res.stderr[-2000:]}")
        row = json.loads(res.stdout.strip().splitlines()[-1])
        xs = sorted(row.pop("seconds"))
        row.update(p50_ms=round(1000 * xs[len(xs) // 2], 1), p95_ms=round(1000 * xs[int(0.95 * (len(xs) - 1))], 1))
        rows.append(row)
        print(row, flush=True)
    for row in rows:
        row["p50_vs_none"] = round(row["p50_ms"] / rows[0]["p50_ms"], 2)
    result = {"provenance": finish(prov),
              "what": "cold sandbox start + first command + close, one at a time, from a mount namespace with "
                      "`extra_mounts` bind mounts added", "load_avg_at_end": os.getloadavg(), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
