"""One weight update through shared memory vs a torch.distributed broadcast vs the relay (http, full snapshots).

All three links are built by furlong's own builder (`furlong.build.links.weight_link`) with the same
engine server processes (`train.sync.engine=server`, `--servers` of them, fp32 engine weights):

* shared: `train.sync.transport=shared`: each push copies the weights into this process's arena in
  /dev/shm and sends every engine a handle; each engine maps the arena and copies the tensors into its
  model (furlong.sync.handover).
* broadcast: `train.sync.transport=broadcast`: the trainer is rank 0 of a gloo group with the engines; each
  push announces the tensors over HTTP and broadcasts them in flat buckets (furlong.sync.broadcast).
* relay: `train.sync.transport=http` with `train.sync.full_every=1`: every push publishes a full snapshot
  (checksummed, zstd) to the run's directory, each engine's relay pulls it from the UpdateServer over HTTP,
  verifies and loads it.

Per model, after one warm-up push each, --updates pushes of freshly perturbed weights (a new version each)
are timed end to end (`sync_seconds`: until every engine has loaded the version; every engine's /health is
checked to report it). Bytes: what one engine receives per update over its socket (`sync_payload_bytes`:
the shared link's handle; the broadcast's raw tensor bytes, tied tensors once; the relay's snapshot
payload; each engine pulls its own copy). Models: `tiny` (the default recipe's, ~4M parameters) and `wide`
(hidden 1024, 8 layers, ~105M parameters), built by `init_tiny`. On a shared 2-core box every link
includes the engines' copy into the model.

    python bench/weight_sync_broadcast.py                     # tiny and wide, 3 updates each, 2 engines
    python bench/weight_sync_broadcast.py --models tiny --updates 5 --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import finish, provenance

from furlong.build.links import weight_link
from furlong.config import load_config
from furlong.model import init_tiny, load_model

RESULTS = Path(__file__).parent / "results" / "weight_sync_broadcast.json"
MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "wide": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8, "head_dim": 64,
             "intermediate_size": 3072},
}
LINKS = {"shared": ["train.sync.transport=shared"], "broadcast": ["train.sync.transport=broadcast"],
         "relay_http_full": ["train.sync.transport=http", "train.sync.full_every=1"]}


def versions(model_dir: Path, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` distinct weight sets: the model's tensors moved by noise each time (tied tensors stay tied)."""
    model = load_model(model_dir)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        state = model.state_dict()
        copies: dict[int, torch.Tensor] = {}  # one copy per storage: tied tensors stay shared, as a trainer's are
        for v in state.values():
            copies.setdefault(v.data_ptr(), v.clone())
        out.append({k: copies[v.data_ptr()] for k, v in state.items()})
    return out


async def measure_link(name: str, model_dir: Path, weights: list[dict[str, torch.Tensor]], servers: int,
                       threads: int) -> dict[str, Any]:
    cfg = load_config(None, [*LINKS[name], "train.sync.engine=server", f"train.sync.servers={servers}",
                             f"train.torch_threads={threads}"])
    with tempfile.TemporaryDirectory(prefix=f"bcast-{name}-") as run:
        link = await weight_link(cfg, Path(run), model_dir)
        try:
            rows = []
            for version, w in enumerate(weights, start=1):
                m = await link.push(w, version)
                router = getattr(link.engine, "instances", None)
                for e in [i.engine for i in router] if router else [link.engine]:
                    assert (await e.health())["weight_version"] == version, f"{name}: an engine missed v{version}"
                rows.append({"seconds": m["sync_seconds"], "payload_bytes": m["sync_payload_bytes"],
                             "pause_s": m.get("sync_pause_s")})
        finally:
            await link.close()
    timed = rows[1:]  # the first push warms up connections and buffers
    return {"updates": timed, "median_seconds": statistics.median(r["seconds"] for r in timed),
            "payload_bytes": timed[-1]["payload_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,wide", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--updates", type=int, default=3, help="timed updates per link (after one warm-up)")
    ap.add_argument("--servers", type=int, default=2, help="engine server processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--out", type=Path, default=RESULTS, help="bench/results/weight_sync_broadcast.json")
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name in args.models.split(","):
        model_dir = init_tiny(seed=0, **MODELS[name])
        weights = versions(model_dir, args.updates + 1)
        params = sum(t.numel() for t in load_model(model_dir).parameters())
        row: dict[str, Any] = {"params": params, "spec": MODELS[name]}
        for link in LINKS:
            row[link] = asyncio.run(measure_link(link, model_dir, weights, args.servers, args.threads))
        sh, b, r = row["shared"], row["broadcast"], row["relay_http_full"]
        row["seconds_ratio_broadcast_over_relay"] = b["median_seconds"] / r["median_seconds"]
        row["bytes_ratio_broadcast_over_relay"] = b["payload_bytes"] / r["payload_bytes"]
        row["seconds_ratio_shared_over_relay"] = sh["median_seconds"] / r["median_seconds"]
        row["seconds_ratio_shared_over_broadcast"] = sh["median_seconds"] / b["median_seconds"]
        results[name] = row
        print(f"{name}: {params / 1e6:.1f}M params; " + "; ".join(
              f"{k} {row[k]['median_seconds']:.3f} s, {row[k]['payload_bytes'] / 2**20:.3f} MiB" for k in LINKS)
              + f"; seconds ratios: shared/relay {row['seconds_ratio_shared_over_relay']:.3f}, shared/broadcast "
              f"{row['seconds_ratio_shared_over_broadcast']:.3f}, broadcast/relay "
              f"{row['seconds_ratio_broadcast_over_relay']:.3f}", flush=True)
    out = {"provenance": finish(prov), "servers": args.servers, "updates": args.updates, "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
