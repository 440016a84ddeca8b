"""Host bytes per publish: the device path (furlong.sync.staging) vs the host path, on a synthetic bf16 model.

Builds weight_sync_synthetic's model (--params bf16 parameters), publishes it as a snapshot, then one delta
per --densities entry, each changing that fraction of every matrix's bf16 words by 1-3 ulps. Two publishers
see the same chain: the host path (a full CPU copy per publish) and the device path (`device_base=True`),
here run on CPU tensors: there is no GPU on this machine, so its byte counts are what a CUDA trainer would
move device -> host, but its seconds say nothing about a GPU. Checks that both payloads are identical.

    python bench/delta_host_bytes.py                 # 2e7 parameters, well under a minute
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from provenance import finish, provenance
from weight_sync_synthetic import build_model

from furlong.sync import read_update
from furlong.sync.publish import Publisher
from furlong.sync.transport import InProcessTransport

RESULTS = Path(__file__).parent / "results" / "delta_host_bytes.json"


def step(w: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: t.clone() for k, t in w.items()}
    for t in out.values():
        words = t.view(torch.int16).reshape(-1)
        pos = torch.randperm(words.numel(), generator=g)[: round(density * words.numel())]
        words[pos] += torch.randint(-1, 2, (pos.numel(),), generator=g, dtype=torch.int16) | 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=2e7)
    ap.add_argument("--densities", default="0.005,0.02,0.05,0.35,0.67")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    w = build_model(int(args.params))
    host_t, dev_t = InProcessTransport(), InProcessTransport()
    host = Publisher(host_t, full_every=100, device_base=False)
    dev = Publisher(dev_t, full_every=100, device_base=True)
    rows = []
    for v, density in enumerate([None, *(float(d) for d in args.densities.split(","))], start=1):
        if density is not None:
            w = step(w, density, seed=v)
        h, d = host.publish(w, v), dev.publish(w, v)
        payload = bytes(dev_t.get(v))
        rows.append({
            "version": v, "kind": d.kind, "density": density, "full_bytes": d.full_bytes,
            "payload_bytes": d.payload_bytes, "host_path_host_bytes": h.host_bytes,
            "device_path_host_bytes": d.host_bytes, "device_over_host": d.host_bytes / h.host_bytes,
            "payload_identical": payload == bytes(host_t.get(v)),
            "layouts": sorted({t.encoding for t in read_update(payload).tensors}),
            "host_encode_s": h.encode_s, "device_encode_s_on_cpu": d.encode_s,
        })
        print(json.dumps(rows[-1]), flush=True)
    assert all(r["payload_identical"] for r in rows), "device path payload differs from the host path's"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    params = sum(t.numel() for t in w.values())
    args.out.write_text(json.dumps({"provenance": finish(prov), "params": params, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
