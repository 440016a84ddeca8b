"""The vLLM CPU leg for the model families (docs/models.md#model-families): each family's tiny variant in
vLLM, one vLLM at a time, each in its own child process (a family vLLM cannot load must not take the others
down): start, sample 16 tokens with logprobs, score the same tokens with the trainer's forward, and record the
largest |vLLM logprob - trainer logprob|, or the error that stopped it.

    python bench/families_vllm.py [--families qwen3,llama3] [--timeout-s 300] [--out bench/results/families_vllm.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import finish, provenance  # noqa: E402


def one(name: str, work: Path) -> dict:
    """In the child: build the family, run it in vLLM, compare logprobs with the trainer's forward."""
    import torch

    from furlong.engine.base import SamplingParams
    from furlong.engine.vllm import VLLMEngine
    from furlong.model.chat import Message, render_prompt_ids
    from furlong.model.families import init_family
    from furlong.model.loading import load_model, load_tokenizer
    from furlong.train.logprobs import token_logprobs

    directory = init_family(name, work / name)
    prompt = render_prompt_ids(load_tokenizer(directory), [Message("user", "List the files in /app.")])
    started = time.perf_counter()
    engine = VLLMEngine.start(directory, eos_token_ids=(), seed=0, max_model_len=512)
    start_s = time.perf_counter() - started
    try:
        gen = asyncio.run(engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)))
    finally:
        asyncio.run(engine.close())
    tokens = torch.tensor([prompt + list(gen.output_ids)])
    with torch.no_grad():
        logp = token_logprobs(load_model(directory), tokens, torch.ones_like(tokens), 1.0)[0, len(prompt) :]
    diff = (logp - torch.tensor(gen.logprobs)).abs()
    return {"ok": True, "start_s": round(start_s, 1), "tokens": len(gen.output_ids),
            "logprob_abs_diff_max": float(diff.max()), "logprob_abs_diff_mean": float(diff.mean())}


def root_cause(stderr: str) -> str:
    """The first exception line that is not vLLM's wrapper (EngineDeadError points at the trace above it)."""
    lines = [x for x in stderr.splitlines() if re.search(r"\w*(Error|Exception): ", x) and "EngineDeadError" not in x]
    return re.sub(r"^\(\w+ pid=\d+\) ERROR [^\]]*\] ", "", lines[0])[:400] if lines else stderr[-400:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="")
    parser.add_argument("--timeout-s", type=float, default=300, help="per family (vLLM starts in 15-70 s when idle)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/families_vllm.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one(args.child, args.work)))
        return
    from furlong.model.families import FAMILIES

    prov = provenance()
    names = [n for n in args.families.split(",") if n] or list(FAMILIES)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            cmd = [sys.executable, __file__, "--child", name, "--work", work]
            try:
                res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s, check=False)
                line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
                results[name] = json.loads(line[7:]) if line else {"ok": False, "error": root_cause(res.stderr)}
            except subprocess.TimeoutExpired:
                results[name] = {"ok": False, "error": f"no result within {args.timeout_s:.0f} s"}
            print(name, results[name], flush=True)
            # after every family: a leg cut short still leaves what it measured
            args.out.write_text(json.dumps({"provenance": finish(prov), "families": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
