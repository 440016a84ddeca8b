"""Inference engines on one multi-turn agent workload: tokens/s, time to first token, weight-update pause.

The workload replays the default recipe's episodes without sandboxes, so every engine gets exactly the same
requests: the prompt of each held-out instance of the default families (the agent's system prompt and the
task's real instruction, rendered by the chat template), then up to `train.agent.max_turns` model turns, each
followed by a tool result, within `train.agent.max_context_tokens`. What a sandbox would return is replaced by
seeded text of 20 to `observation_chars` characters, and each episode's turn count (1 to max_turns) and each
turn's reply length (--reply-tokens, uniform; the default 8-40 mirrors the SFT policy of a default run, about
22 tokens a turn and 2.2 turns an episode; the untrained tiny model never ends a turn itself) are drawn from
its seed: many concurrent episodes of varying length. Sampling is seeded per episode and turn (temperature 1, stop at end of turn), so engines
that compute the same logits produce the same tokens (checked between the hf variants).

Engines (pluggable: ENGINES maps a name to a builder that returns an Engine or a reason to skip):
  hf          today's engine without the prefix cache: one prefill forward per distinct prompt (baseline)
  hf+batch    no prefix cache, prompts admitted together share one right-padded prefill forward
  hf+prefix   prefix cache (default size) + batched prefill: what `furlong train` runs
  vllm        furlong.engine.vllm when importable, else printed as skipped with the reason

Measured per engine, the best of --repeats runs (engines interleaved, so load drifts hit all alike):
  tokens/s   sampled tokens / wall time of the whole workload (and / CPU time of this process and its
             children, vLLM's engine processes included: on a loaded shared machine wall time mostly
             measures the other jobs)
  TTFT       after every --probe-every finished turns, a probe sends that conversation with a probe-only tool
             result as a new turn with max_new_tokens=1 and times it: a new turn's wait under load (the
             same number of probes on every engine)
  pause      wall time of update_weights (the model's own values, a full update) issued after every
             --update-every finished episodes: lock wait + load + cache invalidation; vLLM also holds new
             requests until those in flight finish (pause_drain_mean_s: that part)

    python bench/engines.py                          # 96 episodes, 16 at once, 2 repeats: 3-8 min here
    python bench/engines.py --episodes 48 --repeats 1 --engines hf,hf+prefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

# This checkout's furlong, also when run as a script (the script's own directory is bench/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provenance import finish, provenance  # noqa: E402

from furlong.config import DEFAULT_SYSTEM_PROMPT as SYSTEM_PROMPT  # noqa: E402
from furlong.config import Config  # noqa: E402
from furlong.engine import Engine, SamplingParams  # noqa: E402
from furlong.engine.hf import HFEngine  # noqa: E402
from furlong.model import Message, continuation_ids, end_of_turn_id, init_tiny, load_model, load_tokenizer  # noqa: E402
from furlong.model import render_prompt_ids  # noqa: E402
from furlong.tasks.family import load_family  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "engines.json"
Builder = Callable[[Path], Awaitable["Engine | str"]]



def tree_cpu_s() -> float:
    """CPU seconds of this process and every live descendant: vLLM computes in its engine-core and worker
    processes, which time.process_time() would not count (they live for the whole measured workload)."""
    try:
        import psutil  # comes with vLLM; without it there are no engine processes to count
    except ImportError:
        return time.process_time()
    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total

class Turn(NamedTuple):
    """One model turn: its reply length cap, then the tool result that follows it."""

    max_new_tokens: int
    observation: str


@dataclass(frozen=True)
class EpisodePlan:
    """One replayed episode: its rendered first prompt and its turns (sampling seeds derive from `seed`)."""

    seed: int
    prompt: tuple[int, ...]
    turns: tuple[Turn, ...]


@dataclass
class Measured:
    tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    pause_s: list[float] = field(default_factory=list)
    drain_s: list[float] = field(default_factory=list)  # of pause_s, waiting for requests in flight (vLLM)
    outputs: list[tuple[int, ...]] = field(default_factory=list)  # per episode, all sampled ids in order
    prefix_hit_rate: float | None = None  # reused / prompt tokens of the engine's prefix cache; None: no stats


def plan_workload(tokenizer, episodes: int, seed: int, reply_tokens: tuple[int, int]) -> list[EpisodePlan]:
    """Real prompts of the default families' held-out instances, with seeded turn counts and tool results."""
    cfg = Config().train
    families = [load_family(cfg.tasks / name) for name in cfg.families]
    per_family = -(-episodes // len(families))
    tasks = [t for f in families for t in f.instances("heldout", per_family)]
    rng = random.Random(seed)
    rng.shuffle(tasks)
    words = "total lines error file.txt 42 3.14 ok done /app/data.csv No such file or directory".split()
    plans = []
    for i, task in enumerate(tasks[:episodes]):
        prompt = render_prompt_ids(tokenizer, [Message("system", SYSTEM_PROMPT), Message("user", task.instruction)])
        turns = tuple(Turn(min(rng.randint(*reply_tokens), cfg.agent.max_new_tokens),
                           " ".join(rng.choices(words, k=rng.randint(3, cfg.agent.observation_chars // 6)))
                           [: cfg.agent.observation_chars])
                      for _ in range(rng.randint(1, cfg.agent.max_turns)))
        plans.append(EpisodePlan(seed * 100_000 + i, tuple(prompt), turns))
    return plans


class Workload:
    """Runs the plans on one engine, `concurrency` episodes at once, with the TTFT probe and the updates."""

    def __init__(self, engine: Engine, tokenizer, plans: list[EpisodePlan], *, concurrency: int,
                 update_every: int, probe_every: int, weights: dict[str, torch.Tensor]) -> None:
        self.engine, self.tokenizer, self.plans = engine, tokenizer, plans
        self.concurrency, self.update_every, self.probe_every, self.weights = concurrency, update_every, probe_every, weights
        self.eot = end_of_turn_id(tokenizer)
        self.max_context = Config().train.agent.max_context_tokens
        self.measured = Measured(outputs=[()] * len(plans))
        self.probes: list[asyncio.Task[None]] = []
        self.probe_tail = continuation_ids(tokenizer, [Message("tool", "probe")], close_turn=True)
        self.turns_done = 0
        self.finished = 0
        self.version = 0

    async def run(self) -> Measured:
        slots = asyncio.Semaphore(self.concurrency)
        start, cpu = time.perf_counter(), tree_cpu_s()
        await asyncio.gather(*[self._episode(i, slots) for i in range(len(self.plans))])
        await asyncio.gather(*self.probes)
        self.measured.wall_s = time.perf_counter() - start
        self.measured.cpu_s = tree_cpu_s() - cpu
        return self.measured

    async def _episode(self, index: int, slots: asyncio.Semaphore) -> None:
        plan = self.plans[index]
        ids, sampled = list(plan.prompt), []
        async with slots:
            for k, turn in enumerate(plan.turns):
                budget = self.max_context - len(ids)
                if budget <= 0:
                    break
                gen = await self.engine.generate(ids, SamplingParams(
                    temperature=1.0, max_new_tokens=min(turn.max_new_tokens, budget), stop_token_ids=(self.eot,),
                    seed=plan.seed * 10 + k))
                self.measured.tokens += gen.num_tokens
                self.measured.prompt_tokens += len(ids)
                sampled += gen.output_ids
                ids += gen.output_ids
                self.turns_done += 1
                if self.turns_done % self.probe_every == 0 and len(ids) + len(self.probe_tail) < self.max_context:
                    self.probes.append(asyncio.create_task(self._probe(ids + self.probe_tail)))
                ids += continuation_ids(self.tokenizer, [Message("tool", turn.observation)],
                                        close_turn=gen.finish_reason != "stop")
        self.measured.outputs[index] = tuple(sampled)
        self.finished += 1
        if self.update_every and self.finished % self.update_every == 0:
            self.version += 1
            t = time.perf_counter()
            await self.engine.update_weights(self.weights, self.version)
            self.measured.pause_s.append(time.perf_counter() - t)
            drain = getattr(self.engine, "last_update", {}).get("sync_drain_s")
            if drain is not None:
                self.measured.drain_s.append(drain)

    async def _probe(self, ids: list[int]) -> None:
        t = time.perf_counter()
        await self.engine.generate(ids, SamplingParams(max_new_tokens=1, seed=0))
        self.measured.ttft_s.append(time.perf_counter() - t)


def hf_builder(**options: Any) -> Builder:
    async def build(model_dir: Path) -> Engine | str:
        return HFEngine(load_model(model_dir), eos_token_ids=(), **options)
    return build


async def build_vllm(model_dir: Path) -> Engine | str:
    """Another part of issue 11 writes furlong.engine.vllm; until it is importable this engine is skipped."""
    try:
        import furlong.engine.vllm as vllm_module
    except Exception as e:  # ImportError, or vllm itself failing to import
        return f"furlong.engine.vllm not importable: {type(e).__name__}: {e}"
    try:
        from furlong.engine.factory import make_engine
    except ImportError:
        engine_class = getattr(vllm_module, "VLLMEngine", None)
        if engine_class is None or not hasattr(engine_class, "from_pretrained"):
            return "furlong.engine.vllm has no VLLMEngine.from_pretrained and furlong.engine.factory is missing"
        return await asyncio.to_thread(engine_class.from_pretrained, model_dir)
    engine = make_engine("vllm", model_dir, dtype="float32", seed=0)
    return await engine if asyncio.iscoroutine(engine) else engine


ENGINES: dict[str, Builder] = {
    "hf": hf_builder(prefix_cache_mb=0, batch_prefill=False),
    "hf+batch": hf_builder(prefix_cache_mb=0),
    "hf+prefix": hf_builder(),
    "vllm": build_vllm,
}


async def measure(name: str, model_dir: Path, tokenizer, plans: list[EpisodePlan], args: argparse.Namespace,
                  weights: dict[str, torch.Tensor]) -> Measured | str:
    engine = await ENGINES[name](model_dir)
    if isinstance(engine, str):
        return engine
    try:
        workload = Workload(engine, tokenizer, plans, concurrency=args.concurrency, update_every=args.update_every,
                            probe_every=args.probe_every, weights=weights)
        measured = await workload.run()
        stats = getattr(engine, "stats", None)
        if stats is not None and hasattr(stats, "prefix_hit_rate"):
            measured.prefix_hit_rate = stats.prefix_hit_rate  # the docs' hit-rate column reads it from the JSON
            print(f"  {name}: prefix hit rate {stats.prefix_hit_rate:.3f} ({stats.reused_tokens} of "
                  f"{stats.prompt_tokens} prompt tokens reused), {stats.prefill_calls} prefill forwards")
        return measured
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            await close()


def summarize(m: Measured) -> dict[str, float]:
    return {"tokens_per_s": m.tokens / m.wall_s, "tokens_per_cpu_s": m.tokens / m.cpu_s, "wall_s": m.wall_s,
            "cpu_s": m.cpu_s, "tokens": m.tokens,
            "prompt_tokens": m.prompt_tokens, "ttft_median_s": statistics.median(m.ttft_s) if m.ttft_s else None,
            "ttft_probes": len(m.ttft_s), "load_average_1m": os.getloadavg()[0], "pause_mean_s": statistics.mean(m.pause_s) if m.pause_s else None,
            "pause_max_s": max(m.pause_s, default=None), "updates": len(m.pause_s),
            "pause_drain_mean_s": statistics.mean(m.drain_s) if m.drain_s else None,
            "prefix_hit_rate": m.prefix_hit_rate}


def ratios(row: dict, base: dict) -> dict[str, float | None]:
    def ratio(key: str, invert: bool = False) -> float | None:
        a, b = row.get(key), base.get(key)
        if not a or not b:
            return None
        return b / a if invert else a / b
    # Every ratio reads "x times better than the baseline": speed up, waits down.
    return {"tokens_per_s": ratio("tokens_per_s"), "tokens_per_cpu_s": ratio("tokens_per_cpu_s"),
            "ttft": ratio("ttft_median_s", invert=True),
            "pause": ratio("pause_mean_s", invert=True)}


def print_table(results: dict[str, Any], base: str) -> None:
    head = (f"{'engine':<11}{'tokens/s':>10}{'x ' + base:>9}{'tok/cpu-s':>11}{'x':>7}{'TTFT ms':>10}{'x':>7}"
            f"{'pause ms':>10}{'x':>7}")
    print(head)
    for name, row in results.items():
        if "skipped" in row:
            print(f"{name}: skipped ({row['skipped']})")
            continue
        r = row["ratios"]
        fmt = lambda v, s=1.0, p=1: "-" if v is None else f"{v * s:.{p}f}"  # noqa: E731
        print(f"{name:<11}{fmt(row['tokens_per_s']):>10}{fmt(r['tokens_per_s'], p=2):>9}"
              f"{fmt(row['tokens_per_cpu_s']):>11}{fmt(r['tokens_per_cpu_s'], p=2):>7}"
              f"{fmt(row['ttft_median_s'], 1e3):>10}{fmt(r['ttft'], p=2):>7}"
              f"{fmt(row['pause_mean_s'], 1e3, 2):>10}{fmt(r['pause'], p=2):>7}")


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model) if args.model else init_tiny()
    tokenizer = load_tokenizer(model_dir)
    plans = plan_workload(tokenizer, args.episodes, args.seed, args.reply_tokens)
    weights = {k: v.clone() for k, v in load_model(model_dir).state_dict().items()}
    best: dict[str, Measured | str] = {}
    for repeat in range(args.repeats):
        for name in args.engines:
            print(f"repeat {repeat + 1}/{args.repeats}: {name} ...", flush=True)
            got = await measure(name, model_dir, tokenizer, plans, args, weights)
            prev = best.get(name)
            if not isinstance(prev, Measured) or (isinstance(got, Measured) and got.wall_s < prev.wall_s):
                best[name] = got
    return {"model": str(model_dir), "episodes": len(plans), "turns": sum(len(p.turns) for p in plans),
            "best": best}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    ap.add_argument("--model", help="a local HF checkpoint (default: the tiny model)")
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=Config().train.rl.concurrency)
    ap.add_argument("--update-every", type=int, default=16, help="finished episodes between weight updates")
    ap.add_argument("--probe-every", type=int, default=4, help="finished turns between TTFT probes")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--reply-tokens", default="8,40", help="MIN,MAX tokens of a model turn (uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest for the tiny model here)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    try:
        low, high = (int(x) for x in args.reply_tokens.split(","))
        assert 1 <= low <= high
    except (ValueError, AssertionError):
        ap.error(f"--reply-tokens: expected MIN,MAX with 1 <= MIN <= MAX, got {args.reply_tokens!r}")
    args.reply_tokens = (low, high)
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or not args.engines:
        ap.error(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    torch.set_num_threads(args.threads)
    prov = provenance()
    found = asyncio.run(run_all(args))
    report = {"provenance": finish(prov), **report_of(found, args)}
    print_table(report["engines"], args.engines[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def report_of(found: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Summaries and ratios against the first engine listed (by default `hf`, the engine before this change)."""
    rows: dict[str, Any] = {}
    for name, got in found["best"].items():
        rows[name] = {"skipped": got} if isinstance(got, str) else summarize(got)
    base_name = args.engines[0]
    base = rows[base_name]
    for row in rows.values():
        if "skipped" not in row:
            row["ratios"] = ratios(row, base) if "skipped" not in base else {}
    hf_outputs = {n: g.outputs for n, g in found["best"].items() if n.startswith("hf") and isinstance(g, Measured)}
    same = len({tuple(o) for o in hf_outputs.values()}) <= 1
    print(f"hf variants sampled identical tokens: {same}")
    return {"baseline": base_name, "episodes": found["episodes"], "turns": found["turns"], "model": found["model"],
            "concurrency": args.concurrency, "repeats": args.repeats, "threads": args.threads, "seed": args.seed,
            "hf_variants_identical_tokens": same, "engines": rows, "args": {k: str(v) for k, v in vars(args).items()}}


if __name__ == "__main__":
    sys.exit(main())
