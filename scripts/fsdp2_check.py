"""Two FSDP2 steps at world size 1 on one device, one PASS/FAIL line (run by scripts/gpu_check.sh).

    python -m scripts.fsdp2_check --model DIR [--device cuda|cpu]

On cuda: nccl, bf16 compute over fp32 masters (furlong.train.fsdp2). Passes when both steps update
(version 2, finite loss and gradient norm), the gathered weights are fp32 and moved, and a checkpoint
saved at the end loads back to the same weights. Exit code 1 on failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer
from furlong.train.ranks import LocalRanks
from tests.fsdp2_support import fixed_episodes
from tests.tests_support import grpo


def check(model: Path, device: str) -> str:
    spec = FSDP2Spec(model, grpo(lr=1e-4, micro_batch_size=2, minibatches=2), device=device)
    # token ids inside the model's vocabulary (an id past it is a device-side assert on CUDA)
    vocab = min(500 if device == "cpu" else 10_000, json.loads((model / "config.json").read_text())["vocab_size"])
    trainer = FSDP2Trainer(LocalRanks(spec, 1, timeout_s=300, call_timeout_s=300), spec)
    try:
        before = {k: v.clone() for k, v in trainer.engine_weights().items()}
        start = time.perf_counter()
        stats = [trainer.train_step(fixed_episodes(vocab=vocab, seed=s)) for s in (0, 1)]
        seconds = time.perf_counter() - start
        after = trainer.engine_weights()
        assert trainer.version == 2 and all(s.updated for s in stats), f"version {trainer.version}"
        assert all(math.isfinite(s.loss) and math.isfinite(s.grad_norm) for s in stats), stats
        assert all(v.dtype == torch.float32 for v in after.values()), "master weights are not fp32"
        moved = max(float((after[k] - before[k]).abs().max()) for k in before)
        assert moved > 0, "the weights did not move"
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save(Path(tmp) / "ckpt")
            trainer.load(Path(tmp) / "ckpt")
            again = trainer.engine_weights()
            assert all(torch.equal(again[k], after[k]) for k in after), "a saved checkpoint loads differently"
        return f"2 steps in {seconds:.1f} s, loss {stats[-1].loss:.4g}, grad norm {stats[-1].grad_norm:.3g}, " \
               f"weights moved by up to {moved:.2e}, checkpoint round trip exact"
    finally:
        trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    try:
        detail = check(args.model, args.device)
    except Exception as exc:  # noqa: BLE001  # one FAIL line, the traceback on stderr
        traceback.print_exc()
        print(f"FAIL fsdp2 2 FSDP2 steps on one {args.device.upper()}: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"PASS fsdp2 2 FSDP2 steps on one {args.device.upper()}: {detail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
