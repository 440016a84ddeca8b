"""`furlong eval`: many episodes at bounded concurrency, a JSON line each as it finishes, a table."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import cast

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from furlong.envs.base import Environment
from furlong.envs.harbor import HarborEnv
from furlong.envs.rewards import TESTS_ONLY, Scorer
from furlong.envs.toolset import Tool
from furlong.envs.user import Instance
from furlong.eval.agents import Agent, EpisodeAgents, agent_for
from furlong.eval.harness import EpisodeResult, run_agent
from furlong.eval.passk import pass_at_k_summary
from furlong.metrics.outcomes import Scored, outcome_summary
from furlong.sandbox.base import ImageRef, SandboxError
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.images.toolchain import ToolchainImages
from furlong.sandbox.pool import FreshSandboxes
from furlong.tasks.model import Task, verifier_dockerfiles
from furlong.tasks.suite import BrokenTask


async def prepare_images(tasks: list[Task], store: ImageStore, backend, console: Console) -> dict:
    """Builds every image the tasks need, once each, before any episode starts.

    Returns the task's image source (Task.image_source) -> ImageRef, or -> the error text for images that
    failed to build.
    """
    images: dict = {}
    wanted = list(dict.fromkeys(s for t in tasks for s in (t.image_source, *verifier_dockerfiles(t))))
    with console.status("preparing images") as status:
        for n, source in enumerate(wanted, 1):

            def progress(msg: str, n=n) -> None:
                status.update(f"image {n}/{len(wanted)}: {msg}")

            try:
                images[source] = await store.image(source, backend, progress)
            except Exception as exc:  # noqa: BLE001  # one bad Dockerfile must not stop the others
                images[source] = f"image build failed: {exc}"
                console.print(f"[red]{images[source]}")
    # a stand-in that is not the image the FROM names says so once (its note is also in every record)
    for note in dict.fromkeys(i.note for i in images.values() if not isinstance(i, str) and i.note):
        console.print(f"[yellow]image:[/yellow] {note}", soft_wrap=True, highlight=False)
    return images


@contextlib.contextmanager
def _lines(out: Path | None) -> Iterator[Callable[[EpisodeResult], None]]:
    """Records one JSON line per episode in `out` (none: nothing), flushed per line, so a killed run loses
    nothing finished."""
    sink = open(out, "w") if out else None

    def record(res: EpisodeResult) -> None:
        if sink:
            sink.write(json.dumps(res.to_json()) + "\n")
            sink.flush()

    try:
        yield record
    finally:
        if sink:
            sink.close()


async def run_eval(
    entries: Sequence[Task | BrokenTask | Instance],
    agent: Agent | EpisodeAgents,
    backend,
    store: ImageStore,
    concurrency: int,
    out: Path | None,
    console: Console,
    samples: int = 1,
    tools: Sequence[Tool] = (),
    scorer: Scorer = TESTS_ONLY,
    env: Environment | None = None,
) -> list[EpisodeResult]:
    """`samples` episodes of every task, in `entries`' order. A BrokenTask (one that did not load) is an
    infra_error line of its own, written first; the others' lines are written as each episode ends.
    `tools` and `scorer`: the user's extra tools and reward functions (train.env), as in training. `env`:
    the episodes' environment (a Python one, whose instances `entries` are); None: Harbor tasks in fresh
    sandboxes, their images built first."""
    tasks = [e for e in entries if not isinstance(e, BrokenTask)]
    results = [EpisodeResult.unloadable(e, agent.name) for e in entries if isinstance(e, BrokenTask)]
    with _lines(out) as record:
        for res in results:
            record(res)
        if env is None:  # the entries are Harbor tasks
            env = await harbor_env(cast(list[Task], tasks), backend, store, console, tools, scorer)
        jobs = [(task, k) for task in tasks for k in range(samples)]
        results += await _episodes(jobs, agent, env, concurrency, record, console, len(results) + len(jobs))
    order = {e.id: i for i, e in enumerate(entries)}
    return sorted(results, key=lambda r: (order[r.task], r.sample))


async def harbor_env(
    tasks: list[Task],
    backend,
    store: ImageStore,
    console: Console,
    tools: Sequence[Tool] = (),
    scorer: Scorer = TESTS_ONLY,
) -> HarborEnv:
    """Harbor tasks in fresh sandboxes, every image they need built first (a failed build is each of its
    episodes' infra_error)."""
    images = await prepare_images(tasks, store, backend, console) if tasks else {}
    return HarborEnv(
        FreshSandboxes(backend, ToolchainImages(_prebuilt(images), store, backend)),
        tools,
        scorer,
        store if isinstance(store, ImageStore) else None,
    )


async def run_env_eval(
    specs: Sequence,
    agent: Agent | EpisodeAgents,
    env: Environment,
    concurrency: int,
    out: Path | None,
    console: Console,
    samples: int = 1,
) -> list[EpisodeResult]:
    """`samples` episodes of each of an environment's own instances (an OpenEnv server's), in order."""
    with _lines(out) as record:
        jobs = [(spec, k) for spec in specs for k in range(samples)]
        results = await _episodes(jobs, agent, env, concurrency, record, console, len(jobs))
    order = {s.id: i for i, s in enumerate(specs)}
    return sorted(results, key=lambda r: (order[r.task], r.sample))


async def _episodes(
    jobs: list[tuple[Task | Instance, int]],
    agent: Agent | EpisodeAgents,
    sandboxes: Environment,
    concurrency: int,
    record: Callable[[EpisodeResult], None],
    console: Console,
    total: int,
) -> list[EpisodeResult]:
    sem = asyncio.Semaphore(concurrency)
    results: list[EpisodeResult] = []

    async def one(task: Task, sample: int) -> EpisodeResult:
        async with sem:
            return await run_agent(task, lambda: agent_for(agent, task, sample), sandboxes, sample)

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("pass {task.fields[passed]}"),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        job = bar.add_task(f"eval {agent.name}", total=total, completed=total - len(jobs), passed=0)
        # an Instance has what a Task's result reads (id, family, seed, split)
        for fut in asyncio.as_completed([one(cast(Task, t), k) for t, k in jobs]):
            res = await fut
            results.append(res)
            record(res)
            bar.update(job, advance=1, passed=sum(r.reward == 1.0 for r in results))
    return results


def _prebuilt(images: dict):
    """Task -> the image prepare_images built; a failed build is the episode's infra_error."""

    async def lookup(task: Task) -> ImageRef:
        image = images[task.image_source]
        if isinstance(image, str):
            raise SandboxError(image)
        return image

    return lookup


def summarize(results: list[EpisodeResult]) -> dict:
    """pass_rate and per-family rates over the scored episodes; every status counted; pass@k over each
    task's samples (furlong.eval.passk), overall, per family (inside `per_family`) and per task."""
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    s = outcome_summary([Scored(r.family, r.reward, r.status) for r in results])
    pk = pass_at_k_summary(_by_task(results), max((r.sample for r in results), default=0) + 1)
    return {
        "episodes": s["episodes"],
        "scored": s["scored"],
        "infra_errors": s["infra_errors"],
        "pass_rate": s["pass_at_1"],
        "mean_reward": s["mean_reward"],
        "status": s["status"],
        "per_family": {
            name: {**rates, "pass_at_k": pk["per_family"].get(name, {})} for name, rates in s["per_family"].items()
        },
        "samples": pk["samples"],
        "ks": pk["ks"],
        "pass_at_k": pk["pass_at_k"],
        "per_task": pk["per_task"],
        "mean_timing_s": {
            k: mean([getattr(r.timing, k) for r in results])
            for k in ("sandbox_start", "model_wait", "agent_commands", "verifier", "other")
        },
    }


def _by_task(results: list[EpisodeResult]) -> list[tuple[str, str | None, list[Scored]]]:
    """(task, family, its episodes) in first-seen order."""
    tasks: dict[str, tuple[str | None, list[Scored]]] = {}
    for r in results:
        tasks.setdefault(r.task, (r.family, []))[1].append(Scored(r.family, r.reward, r.status))
    return [(task, family, episodes) for task, (family, episodes) in tasks.items()]


STATUS_STYLE = {"infra_error": "yellow", "agent_broke_sandbox": "red", "reward_tampered": "red"}


def print_table(results: list[EpisodeResult], console: Console) -> None:
    table = Table(title="furlong eval")
    for col in ("task", "sample", "reward", "status", "start s", "agent s", "verify s", "other s", "note"):
        table.add_column(col, justify="right" if col.endswith(" s") or col == "reward" else "left")
    for r in results:
        t = r.timing
        reward = "-" if r.reward is None else f"{r.reward:g}"
        style = "green" if r.reward == 1.0 else STATUS_STYLE.get(r.status)
        table.add_row(
            r.task,
            str(r.sample),
            reward,
            r.status,
            f"{t.sandbox_start:.3f}",
            f"{t.agent_commands:.3f}",
            f"{t.verifier:.3f}",
            f"{t.other:.3f}",
            (r.error or "")[:60],
            style=style,
        )
    console.print(table)
    s = summarize(results)
    console.print(
        f"episodes {s['episodes']}  scored {s['scored']}  pass rate {s['pass_rate']:.3f}  "
        f"mean reward {s['mean_reward']:.3f}  infra errors (unscored) {s['infra_errors']}"
    )
    console.print("status  " + "  ".join(f"{k} {v}" for k, v in s["status"].items()))
    for name, f in s["per_family"].items():
        console.print(
            f"family {name}: pass rate {f['pass_at_1']:.3f} over {f['scored']} scored, "
            f"{f['infra_errors']} infra errors" + _pass_at_k_text(f["pass_at_k"], s["samples"])
        )
    if s["samples"] > 1:
        console.print(f"all tasks, {s['samples']} samples each:" + _pass_at_k_text(s["pass_at_k"], s["samples"]))


def _pass_at_k_text(values: dict[str, float | None], samples: int) -> str:
    if samples < 2:
        return ""
    return "  " + "  ".join(f"pass@{k} " + ("-" if v is None else f"{v:.3f}") for k, v in values.items())
