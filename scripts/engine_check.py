"""Check one inference engine for real and print one PASS/FAIL line per check (run by scripts/gpu_check.sh).

    python -m scripts.engine_check --engine sglang|vllm --model DIR --work DIR [--sglang-module M] [...]

Checks: start, generate, logprobs vs the trainer's recomputation, weight update (outputs change, version
bumps, the measured pause), LoRA (an adapter's logprobs match the merged model's), 2 RL steps through
`furlong train train.engine=...`. Only the Engine protocol and furlong.engine.factory are used, so one
script checks every backend. Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from furlong.config import SGLangConfig
from furlong.engine.base import SamplingParams
from furlong.engine.factory import make_engine
from furlong.model.loading import load_model, load_tokenizer
from furlong.train.logprobs import token_logprobs

LOGPROB_TOL = 1e-2  # GPU kernels vs the trainer's fp32 CPU forward; the measured value is printed
RESULTS: list[tuple[str, bool]] = []
ENGINE = ["engine"]  # set by main(): every line names the engine it checked


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {ENGINE[0]} {name}: {detail}", flush=True)


async def check(name: str, body: Callable[[], Awaitable[str]]) -> None:
    """Run one check; an exception is that check's FAIL, never the end of the script."""
    try:
        report(name, True, await body())
    except Exception as e:  # noqa: BLE001  a failed check is reported, the others still run
        report(name, False, f"{type(e).__name__}: {e}"[:2000])


def max_diff(model, prompt: list[int], gen, temperature: float) -> float:
    tokens = torch.tensor([prompt + list(gen.output_ids)])
    with torch.no_grad():
        ref = token_logprobs(model, tokens, torch.ones_like(tokens), temperature)[0, len(prompt):]
    return (ref - torch.tensor(gen.logprobs)).abs().max().item()


def perturbed(model, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: v.detach() + scale * v.detach().std() * torch.randn(v.shape, generator=g)
            for k, v in model.named_parameters()}


def open_engine(args: argparse.Namespace, work: Path, adapter: Path | None = None):
    sglang = SGLangConfig(launch_module=args.sglang_module, python=args.sglang_python,
                          extra_args=tuple(args.sglang_arg), start_timeout_s=args.start_timeout_s)
    return make_engine(args.engine, args.model, adapter=adapter, sglang=sglang, work_dir=work)


async def close(engine) -> None:
    if hasattr(engine, "close"):
        await engine.close()


async def base_checks(args: argparse.Namespace, prompt: list[int], model) -> None:
    start = time.perf_counter()
    try:
        engine = await asyncio.to_thread(open_engine, args, args.work / "base")
    except Exception as e:  # noqa: BLE001  reported; the later checks start their own engines
        report("start", False, f"{type(e).__name__}: {e}"[:3000])
        return
    report("start", True, f"{args.engine} ready in {time.perf_counter() - start:.1f} s")
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    first = []

    async def generate() -> str:
        gen = await engine.generate(prompt, greedy)
        assert gen.num_tokens > 0 and len(gen.logprobs) == gen.num_tokens, gen
        first.append(gen)
        return f"{gen.num_tokens} tokens, finish {gen.finish_reason}, version {gen.weight_version}"

    async def logprobs() -> str:
        gen = await engine.generate(prompt, SamplingParams(temperature=0.7, max_new_tokens=16, seed=1))
        diff = max_diff(model, prompt, gen, 0.7)
        assert diff <= LOGPROB_TOL, f"max |engine - trainer| = {diff:.2e} > {LOGPROB_TOL}"
        return f"max |engine - trainer| logprob = {diff:.2e} over {gen.num_tokens} tokens (temperature 0.7)"

    async def weight_update() -> str:
        new = perturbed(model, 0.5)
        start = time.perf_counter()
        await engine.update_weights(new, 1)
        seconds = time.perf_counter() - start
        gen = await engine.generate(prompt, greedy)
        assert gen.weight_version == 1, f"version {gen.weight_version} after update to 1"
        assert gen.logprobs != first[0].logprobs, "outputs did not change"
        costs = ", ".join(f"{k} {v:.3f} s" for k, v in getattr(engine, "last_update", {}).items())
        return f"version 0 -> 1, outputs changed; update {seconds:.3f} s ({costs or 'no breakdown'})"

    async def tensor_update() -> str:  # SGLang's second route: restore the original weights from tensors
        await engine.update_weights_from_tensor(dict(model.named_parameters()), 2)
        gen = await engine.generate(prompt, greedy)
        assert gen.weight_version == 2 and gen.output_ids == first[0].output_ids, "original outputs not restored"
        return f"version 1 -> 2, original greedy output restored; pause {engine.last_update['sync_pause_s']:.3f} s"

    checks = [("generate", generate), ("logprobs", logprobs), ("weight update", weight_update)]
    if hasattr(engine, "update_weights_from_tensor"):
        checks.append(("weight update from tensor", tensor_update))
    for name, body in checks:
        await check(name, body)
    await close(engine)


def save_adapter(model_dir: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_model(model_dir), lora).save_pretrained(out)
    return out


async def lora_check(args: argparse.Namespace, prompt: list[int], base) -> None:
    from peft import PeftModel

    adapter = save_adapter(args.model, args.work / "adapter")
    merged = PeftModel.from_pretrained(load_model(args.model), str(adapter)).merge_and_unload()

    async def body() -> str:
        engine = await asyncio.to_thread(open_engine, args, args.work / "lora", adapter)
        try:
            gen = await engine.generate(prompt, SamplingParams(temperature=0.7, max_new_tokens=16, seed=1))
        finally:
            await close(engine)
        diff, vs_base = max_diff(merged, prompt, gen, 0.7), max_diff(base, prompt, gen, 0.7)
        assert diff <= LOGPROB_TOL < vs_base, f"vs merged {diff:.2e}, vs base {vs_base:.2e}"
        return f"adapter loaded; max |engine - merged model| = {diff:.2e} (base model: {vs_base:.2e})"

    await check("lora", body)


def rl_check(args: argparse.Namespace) -> None:
    run_dir = args.work / "rl-run"
    cmd = [sys.executable, "-m", "furlong.cli", "train", "--config", "recipes/smoke.yaml", f"train.engine={args.engine}",
           f"train.model.path={args.model}", "train.rl.steps=2", f"train.run_dir={run_dir}",
           f"train.torch_threads={args.torch_threads}", "train.eval.heldout_per_family=1"]
    if args.engine == "sglang":
        cmd += [f"train.sglang.launch_module={args.sglang_module}",
                f"train.sglang.extra_args={json.dumps(args.sglang_arg)}"]
        if args.sglang_python:
            cmd.append(f"train.sglang.python={args.sglang_python}")
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    summary = run_dir / "summary.json"
    if done.returncode != 0 or not summary.is_file():
        report("rl 2 steps", False, f"exit {done.returncode}: {done.stderr[-1500:]}")
        return
    steps = json.loads(summary.read_text())["rl_steps"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pauses = [r["sync_pause_s"] for r in rows if r.get("phase") == "rl" and "sync_pause_s" in r]
    pause = f", weight-update pause {max(pauses):.3f} s max" if pauses else ""
    report("rl 2 steps", steps == 2, f"{steps} RL steps in {time.perf_counter() - start:.0f} s{pause}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--sglang-module", default="sglang.launch_server")
    ap.add_argument("--sglang-python", default=None)
    ap.add_argument("--sglang-arg", action="append", default=[], help="an extra launch_server flag (repeat)")
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--torch-threads", type=int, default=8)
    args = ap.parse_args()
    ENGINE[0] = args.engine
    args.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.torch_threads)
    prompt = load_tokenizer(args.model, require_chat_template=False)("The capital of France is")["input_ids"]
    model = load_model(args.model)
    asyncio.run(base_checks(args, prompt, model))
    asyncio.run(lora_check(args, prompt, model))
    rl_check(args)
    failed = [name for name, ok in RESULTS if not ok]
    print(f"{args.engine}: {len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed"
          + (f" (failed: {', '.join(failed)})" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
