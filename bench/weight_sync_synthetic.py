"""Weight-sync benchmark: furlong deltas vs the XOR+zstd reference on a synthetic bf16 model.

Builds a model of --params bf16 parameters (16 matrices plus two 1-D norm vectors), then for
each target density simulates two optimizer steps (lr calibrated so that the wanted fraction
of bf16 values changes per step). The first is sent untimed through a delta chain with momentum
(furlong.sync.momentum), as Publisher and Relay do; the second is measured: encoded with furlong
(predicted from the first) and with XOR+zstd-1, both applied onto a copy of the old weights. It
reports payload sizes, ratios (to the full bf16 size, to each other, to the empirical entropy
bound; "plain" = furlong without momentum) and single-thread encode/apply throughput.

Step model (--master): "residual" keeps an fp32 master = bf16 weights + a random sub-ulp
residual (what a real fp32 master looks like after some training), "bf16" starts the master
from the bf16 weights exactly. Either way: master += lr*randn + lr*sign(randn) (SGD noise
plus an AdamW-like sign step whose direction persists across steps, like Adam's momentum), new
weights = bf16(master).

Throughput is GB of full bf16 tensor bytes per second of this thread's CPU time (best of
--repeats), with torch.set_num_threads(1), zstd without worker threads: one core. Encode writes
into one output buffer reused from repeat to repeat, as a Publisher reuses it from update to update
(the first repeat pays its page faults). Wall-clock
numbers are in the JSON too (they suffer when the machine is shared). Memory: four model
copies (prev, mid, new, receiver), momentum states (up to 2 bytes per word at each end)
plus per-tensor temporaries.

    python bench/weight_sync_synthetic.py                 # 1.07 B parameters, ~10 min
    python bench/weight_sync_synthetic.py --params 2e7    # quick check
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from provenance import finish, provenance

from furlong.sync import (
    apply_delta,
    delta_entropy_bound,
    encode_delta,
    read_update,
    xor_zstd_apply,
    xor_zstd_encode,
)
from furlong.sync.checksum import DEFAULT_ALGO
from furlong.sync.momentum import Momentum

Model = dict[str, torch.Tensor]
RESULTS = Path(__file__).parent / "results" / "weight_sync_synthetic.json"


def build_model(params: int, seed: int = 0) -> Model:
    """16 bf16 matrices (init std 0.006..0.05) of ~params/16 values each, plus 2 norm vectors."""
    g = torch.Generator().manual_seed(seed)
    cols = 4096 if params >= 16 * 4096 * 16 else 256
    rows = max(1, params // 16 // cols)
    model = {}
    for i in range(16):
        std = 0.006 * (1.15**i)
        model[f"layers.{i}.weight"] = (torch.randn(rows, cols, generator=g) * std).bfloat16()
    for i in range(2):
        model[f"norm.{i}.weight"] = (1 + 0.05 * torch.randn(cols, generator=g)).bfloat16()
    return model


def master_of(w: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    """fp32 master for bf16 weights `w`: exactly w, or w plus a residual below half an ulp."""
    m = w.float()
    if kind == "bf16":
        return m
    bits = m.view(torch.int32) & 0x7F800000  # exponent field of w
    ulp = (bits - (7 << 23)).clamp(min=1 << 23).view(torch.float32)  # 2**(e - 7): bf16 ulp
    residual = (torch.rand(m.shape, generator=g) - 0.5) * ulp
    candidate = m + residual
    # Near powers of two the ulp below is half as large: keep only residuals that round back.
    return torch.where(candidate.bfloat16() == w, candidate, m)


def step_tensor(w: torch.Tensor, lr: float, kind: str, seed: int, direction: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = master_of(w, kind, g)
    m.add_(torch.randn(m.shape, generator=g), alpha=lr)
    # Adam's sign-like step keeps its direction from step to step (momentum): seeded per tensor, not per step.
    m.add_(torch.sign(torch.randn(m.shape, generator=torch.Generator().manual_seed(direction))), alpha=lr)
    return m.bfloat16()


def simulate_step(model: Model, lr: float, kind: str, seed: int) -> Model:
    return {name: step_tensor(w, lr, kind, seed + i, 10_000 + i) for i, (name, w) in enumerate(model.items())}


def advance(chain: Chain, prev: Model, new: Model, receiver: Model) -> None:
    """Run one untimed link prev -> new through the chain (both momentum states record it); the
    receiver ends at `new`."""
    v = chain.version
    payload = encode_delta(prev, new, version=v, base_version=v - 1, momentum=chain.sender)
    if chain.sender is not None:
        chain.sender.commit()
    copy_into(receiver, prev)
    apply_delta(receiver, payload, current_version=v - 1, momentum=chain.receiver)
    chain.version += 1


def calibrate_lr(model: Model, density: float, kind: str, sample: int = 1 << 16) -> float:
    """Learning rate giving `density` changed values, by bisection on a sample of each tensor."""
    part = {k: v.reshape(-1)[:sample] for k, v in model.items()}
    total = sum(v.numel() for v in part.values())
    lo, hi = 1e-10, 1.0
    for _ in range(40):
        lr = (lo * hi) ** 0.5
        new = simulate_step(part, lr, kind, seed=12345)
        changed = sum(
            int((new[k].view(torch.int16) != v.view(torch.int16)).sum()) for k, v in part.items()
        )
        lo, hi = (lr, hi) if changed < density * total else (lo, lr)
    return (lo * hi) ** 0.5


def timed(
    fn: Callable[[], Any], repeats: int, reset: Callable[[], None] | None = None
) -> tuple[Any, dict]:
    """Best-of-`repeats` thread CPU time and wall time of fn (reset runs untimed before each)."""
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        if reset:
            reset()
        c0, w0 = time.thread_time(), time.perf_counter()
        out = fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return out, {"cpu_s": min(cpu), "wall_s": min(wall), "wall_median_s": float(np.median(wall))}


def mismatches(got: Model, want: Model) -> int:
    return sum(int((got[k].view(torch.int16) != want[k].view(torch.int16)).sum()) for k in want)


def copy_into(dst: Model, src: Model) -> None:
    for k, v in src.items():
        dst[k].copy_(v)


def measure(prev: Model, new: Model, receiver: Model, repeats: int, chain: Chain | None = None
            ) -> dict[str, Any]:
    """Encode + apply with furlong and with XOR+zstd; sizes, times, bound, bit mismatches.

    With `chain`, furlong codes the delta as the next link of that chain, momentum prediction included
    (what Publisher and Relay do), and "furlong_plain_bytes" is the same delta without it."""
    full = sum(v.numel() * v.element_size() for v in new.values())
    chain = chain or Chain(None, None, 1)
    v, before = chain.version, copy.deepcopy(chain.receiver)

    def reset() -> None:  # the receiver's tensors and momentum as they were before this update
        copy_into(receiver, prev)
        if chain.receiver is not None:
            chain.receiver.__dict__.update(copy.deepcopy(before).__dict__)

    out = bytearray()  # reused from repeat to repeat, as a Publisher reuses it from update to update
    payload, enc = timed(
        lambda: encode_delta(prev, new, version=v, base_version=v - 1, momentum=chain.sender, out=out), repeats)
    _, app = timed(lambda: apply_delta(receiver, payload, current_version=v - 1, momentum=chain.receiver),
                   repeats, reset)
    if chain.sender is not None:
        chain.sender.commit()
    bad = mismatches(receiver, new)
    plain = len(payload) if chain.sender is None else len(encode_delta(prev, new, version=v, base_version=v - 1))
    chain.version += 1
    xor, xenc = timed(lambda: xor_zstd_encode(prev, new), repeats)
    _, xapp = timed(lambda: xor_zstd_apply(receiver, xor, list(new)), repeats, lambda: copy_into(receiver, prev))
    xbad = mismatches(receiver, new)
    bound = delta_entropy_bound(prev, new)
    upd = read_update(payload)
    gbps = lambda t: full / t["cpu_s"] / 1e9
    return {
        "full_bytes": full,
        "changed": bound.n_changed,
        "density": bound.n_changed / (full / 2),
        "furlong_bytes": len(payload),
        "furlong_plain_bytes": plain,
        "xor_zstd_bytes": len(xor),
        "bound_bytes": bound.bytes,
        "furlong_over_full": len(payload) / full,
        "xor_over_full": len(xor) / full,
        "furlong_over_xor": len(payload) / len(xor),
        "plain_over_xor": plain / len(xor),
        "furlong_over_bound": len(payload) / bound.bytes,
        "xor_over_bound": len(xor) / bound.bytes,
        "encode_gbps": gbps(enc),
        "apply_gbps": gbps(app),
        "xor_encode_gbps": gbps(xenc),
        "xor_apply_gbps": gbps(xapp),
        "timings": {"encode": enc, "apply": app, "xor_encode": xenc, "xor_apply": xapp},
        "bit_mismatches": bad,
        "xor_bit_mismatches": xbad,
        "encodings": dict(Counter(t.encoding for t in upd.tensors)),
        "predicted": sum(t.predicted for t in upd.tensors),
    }


@dataclass
class Chain:
    """Both ends of a delta chain with momentum (None: plain deltas); `version` is the next update's."""

    sender: Momentum | None
    receiver: Momentum | None
    version: int

    @classmethod
    def with_momentum(cls) -> Chain:
        return cls(Momentum(), Momentum(), 1)


COLUMNS = [  # (header, key, format)
    ("master", "master", "{}"),
    ("density", "density", "{:.2%}"),
    ("furlong B", "furlong_bytes", "{:,}"),
    ("xor+zstd B", "xor_zstd_bytes", "{:,}"),
    ("furlong/full", "furlong_over_full", "{:.4f}"),
    ("xor/full", "xor_over_full", "{:.4f}"),
    ("furlong/xor", "furlong_over_xor", "{:.3f}"),
    ("plain/xor", "plain_over_xor", "{:.3f}"),
    ("furlong/bound", "furlong_over_bound", "{:.3f}"),
    ("xor/bound", "xor_over_bound", "{:.2f}"),
    ("enc GB/s", "encode_gbps", "{:.2f}"),
    ("apply GB/s", "apply_gbps", "{:.2f}"),
    ("xor enc GB/s", "xor_encode_gbps", "{:.2f}"),
    ("xor apply GB/s", "xor_apply_gbps", "{:.2f}"),
    ("mismatch", "bit_mismatches", "{}"),
]


def print_table(rows: list[dict[str, Any]], title: str, columns: list = COLUMNS,
                is_total: Callable[[dict[str, Any]], bool] = lambda row: False) -> None:
    """One row per measurement; rows marked `is_total` are bold and close a section."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h, _, _ in columns:
        table.add_column(h, justify="right")
    for r in rows:
        total = is_total(r)
        table.add_row(*(fmt.format(r[key]) for _, key, fmt in columns), style="bold" if total else None,
                      end_section=total)
    Console(width=220).print(table)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores_visible": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "checksum": DEFAULT_ALGO,
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "throughput": "full bf16 bytes / best thread CPU time",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--params", type=float, default=16 * (1 << 26), help="bf16 parameters (~1.07e9)"
    )
    ap.add_argument("--densities", default="0.005,0.02,0.05")
    ap.add_argument("--master", default="residual,bf16", help="step models, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)  # one core: the per-core numbers are the point
    env = environment(args)
    prev = build_model(int(args.params))
    receiver = {k: v.clone() for k, v in prev.items()}
    n_params = sum(v.numel() for v in prev.values())
    rows = []
    for kind in args.master.split(","):
        for density in (float(d) for d in args.densities.split(",")):
            lr = calibrate_lr(prev, density, kind)
            # Two steps: the first records momentum at both ends, the second is measured, predicted from it.
            mid = simulate_step(prev, lr, kind, seed=1)
            new = simulate_step(mid, lr, kind, seed=2)
            chain = Chain.with_momentum()
            advance(chain, prev, mid, receiver)
            row = {
                "master": kind,
                "target_density": density,
                "lr": lr,
                **measure(mid, new, receiver, args.repeats, chain),
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "timings"}), flush=True)
            del mid, new
    env["loadavg_end"] = os.getloadavg()
    title = f"weight sync, {n_params / 1e9:.2f} B bf16 params, 1 thread (GB/s of full bf16 bytes per CPU-second)"
    print_table(rows, title)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"provenance": finish(prov), "params": n_params, "environment": env, "rows": rows}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
