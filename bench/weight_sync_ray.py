"""Colocated on Ray: one weight update from the trainer actor to the engine actors, handed over in shared
memory vs published through the driver (http, full snapshots).

Both runs use `furlong train`'s own builders on one local Ray cluster (`train.cluster=ray`, colocated, two hf
engine actors behind the router):

* shared: `train.sync.transport=shared`: the trainer actor copies its weights into its arena in /dev/shm
  and the driver sends each engine actor a handle; each maps the arena and copies the tensors in.
* relay: `train.sync.transport=http` with `train.sync.full_every=1`: the trainer actor sends the driver a
  copy of its weights (Ray's object store), the driver publishes a full snapshot (checksummed, zstd) and
  each engine's relay pulls it over HTTP, verifies and loads it.

Each update is timed from asking the trainer for its weights (`engine_weights()`, which is where the relay's
copy leaves the actor) until every engine has loaded the version, after one warm-up update. The trainer
actor holds a stand-in for training (`Perturbing`: each step moves every weight by noise), since what is
measured is the weights' way to the engines. Bytes: what crosses a socket or Ray's object store per
update, per engine (`per_engine_bytes`) and into the driver (`driver_bytes`). Models as in
bench/weight_sync_broadcast.py.

    python bench/weight_sync_ray.py                        # tiny and wide, 3 updates each
    python bench/weight_sync_ray.py --models tiny --updates 5 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import finish, provenance
from weight_sync_broadcast import MODELS

import furlong.build.cluster as ray_build
from furlong.build.links import weight_link
from furlong.cluster.session import RaySession, Roles
from furlong.config import load_config
from furlong.model import init_tiny, load_model
from furlong.sync.handover import SharedWeights

RESULTS = Path(__file__).parent / "results" / "weight_sync_ray.json"
LINKS = {"shared": ["train.sync.transport=shared"],
         "relay_http_full": ["train.sync.transport=http", "train.sync.full_every=1"]}
ENGINES = 2


class Perturbing:
    """A stand-in for the trainer (Trainer protocol, as much as this bench calls): each step moves every
    weight by noise, as a real step would change them."""

    device = torch.device("cpu")

    def __init__(self, model_dir: Path) -> None:
        self.model, self.version = load_model(model_dir), 0
        self._g = torch.Generator().manual_seed(0)

    def train_step(self, episodes: list) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=self._g))
        self.version += 1

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


async def measure_link(name: str, session: RaySession, model_dir: Path, updates: int) -> dict[str, Any]:
    cfg = load_config(None, ["train.cluster=ray", f"train.ray.engines={ENGINES}", "train.ray.engine_cpus=0.5",
                             "train.ray.trainer_cpus=0.5", *LINKS[name]])
    trainer = ray_build.trainer(session, partial(Perturbing, model_dir), cfg.train)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix=f"ray-{name}-") as run:
            link = await weight_link(cfg, Path(run), model_dir, cluster=session)
            try:
                for _ in range(updates + 1):
                    await asyncio.to_thread(trainer.train_step, [])
                    start = time.perf_counter()
                    weights = await asyncio.to_thread(trainer.engine_weights)
                    m = await link.push(weights, trainer.version)
                    seconds = time.perf_counter() - start
                    for i in link.engine.instances:
                        assert (await i.engine.health())["weight_version"] == trainer.version
                    shared = isinstance(weights, SharedWeights)
                    copied = 0 if shared else sum(t.numel() * t.element_size() for t in weights.values())
                    rows.append({"seconds": seconds, "push_seconds": m["sync_seconds"],
                                 "per_engine_bytes": m["sync_payload_bytes"],
                                 "driver_bytes": copied + (m["sync_payload_bytes"] * ENGINES if shared else 0),
                                 "pause_s": m.get("sync_pause_s")})
            finally:
                await link.close()
    finally:
        trainer.close()
    timed = rows[1:]  # the first update warms up connections, buffers and the arena
    return {"updates": timed, "median_seconds": statistics.median(r["seconds"] for r in timed),
            "per_engine_bytes": timed[-1]["per_engine_bytes"], "driver_bytes": timed[-1]["driver_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,wide", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--updates", type=int, default=3, help="timed updates per link (after one warm-up)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="bench/results/weight_sync_ray.json")
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    session = RaySession(Roles(engines=ENGINES, engine_cpus=0.5, trainer_cpus=0.5, placement="colocated"),
                         timeout_s=180)
    results: dict[str, Any] = {}
    try:
        for name in args.models.split(","):
            model_dir = init_tiny(seed=0, **MODELS[name])
            params = sum(t.numel() for t in load_model(model_dir).parameters())
            row: dict[str, Any] = {"params": params, "spec": MODELS[name]}
            for link in LINKS:
                row[link] = asyncio.run(measure_link(link, session, model_dir, args.updates))
            sh, r = row["shared"], row["relay_http_full"]
            row["seconds_ratio_shared_over_relay"] = sh["median_seconds"] / r["median_seconds"]
            results[name] = row
            print(f"{name}: {params / 1e6:.1f}M params; shared {sh['median_seconds']:.3f} s "
                  f"({sh['driver_bytes'] / 2**20:.3f} MiB through the driver); relay {r['median_seconds']:.3f} s "
                  f"({r['driver_bytes'] / 2**20:.1f} MiB through the driver, {r['per_engine_bytes'] / 2**20:.1f} "
                  f"MiB to each engine); seconds ratio {row['seconds_ratio_shared_over_relay']:.3f}", flush=True)
    finally:
        session.close()
    out = {"provenance": finish(prov), "engines": ENGINES, "updates": args.updates, "models": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
