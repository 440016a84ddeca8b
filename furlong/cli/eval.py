"""`furlong eval`: an agent on tasks (Harbor, your own environment, an OpenEnv server), scored."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.cli.common import (
    build_base_image,
    config_of,
    console,
    sandbox_pieces,
)
from furlong.config import Config, ConfigError

if TYPE_CHECKING:
    from furlong.envs.prompts import PromptSource
    from furlong.envs.user import PythonSource


def cmd_eval(args: argparse.Namespace) -> int:
    from furlong.build.sandbox import network_default
    from furlong.eval.agents import make_agent
    from furlong.eval.model import check_model_flags
    from furlong.eval.run import print_table, summarize
    from furlong.tasks.suite import load_suite

    cfg = config_of(
        args,
        {
            "tasks": "eval.tasks",
            "agent": "eval.agent",
            "concurrency": "eval.concurrency",
            "out": "eval.out",
            "split": "eval.split",
            "per_family": "eval.per_family",
            "model": "eval.model",
            "adapter": "eval.adapter",
            "engine": "eval.engine",
            "samples": "eval.samples",
            "temperature": "eval.temperature",
            "seed": "eval.seed",
        },
    )
    e = cfg.eval
    if args.verify_receipts is not None:
        return _verify_receipts(cfg, args.verify_receipts)
    check_model_flags(e)
    if cfg.train.env.python is not None or cfg.train.env.prompts.active:
        return _own_env_eval(cfg)
    if e.env == "openenv":
        return _eval_openenv(cfg)
    backend, store = sandbox_pieces(cfg)  # family generators run on the configured backend too
    suite = load_suite(
        e.tasks, split=e.split, per_family=e.per_family, backend=backend, network=network_default(cfg.sandbox)
    )
    agent = make_agent(e.agent) if e.agent != "model" else _model_agents(cfg)
    if e.verifier_toolchain:
        from furlong.sandbox.images.toolchain import opt_in_all

        suite = type(suite)(opt_in_all(suite.entries))
    for broken in suite.broken:  # each is also an infra_error line in --out and the table
        console.print(f"[yellow]not loaded:[/yellow] {broken.error}", soft_wrap=True)
    build_base_image(store)
    console.print(
        f"{len(suite.tasks)} tasks ({len(suite.broken)} not loaded) from {e.tasks}, agent {e.agent}, "
        f"{e.samples} sample(s) each, concurrency {e.concurrency}"
    )
    results = asyncio.run(_eval_episodes(cfg, suite.entries, agent, backend, store))
    print_table(results, console)
    print(json.dumps(summarize(results)))
    return 0


def _verify_receipts(cfg: Config, path: Path) -> int:
    """`--verify-receipts FILE`: each receipt of FILE against eval.tasks as it is now; 1 when any changed."""
    from rich.markup import escape

    from furlong.envs.separate import BundledTests
    from furlong.eval.receipts import TaskFinder, check_file, summary
    from furlong.sandbox.pool import StoreImages

    if not path.is_file():
        raise ValueError(f"--verify-receipts: {path}: no such file")
    backend, store = sandbox_pieces(cfg)
    finder = TaskFinder(cfg.eval.tasks, backend)
    with console.status(f"checking the receipts of {path} against {cfg.eval.tasks}"):
        checks = asyncio.run(check_file(path, finder, StoreImages(store, backend), BundledTests(store)))
    for c in checks:
        style = {"changed": "red", "no_receipt": "yellow"}.get(c.verdict, "green")
        console.print(f"[{style}]{escape(c.line_text())}[/{style}]", soft_wrap=True, highlight=False)
    counts = summary(checks)
    print(json.dumps(counts))
    return 1 if counts["changed"] else 0


def _own_env_eval(cfg: Config) -> int:
    """`furlong eval` of a Python environment (train.env.python) or a prompt dataset (train.env.prompts):
    eval.per_family instances of each split of eval.split."""
    from furlong.build.environment import prompt_source, python_source, run_env
    from furlong.eval.agents import AnswerAgent, make_agent
    from furlong.eval.run import run_eval

    e, t = cfg.eval, cfg.train
    splits = ("train", "heldout") if e.split == "all" else (e.split,)
    if t.env.prompts.active:
        if e.agent == "oracle" and t.env.prompts.answer_field is None:
            raise ConfigError(
                "--agent oracle answers a prompt row's reference answer: set "
                "train.env.prompts.answer_field, or use --agent noop or model"
            )
        source: PromptSource | PythonSource
        what: str | None
        source, what = prompt_source(t.env, {s: e.per_family for s in splits if e.per_family}), t.env.prompts.family()
    else:
        if e.agent == "oracle":
            raise ConfigError("--agent oracle: a Python environment has no oracle solution; use --agent noop or model")
        every = {"train": t.env.train_instances, "heldout": t.eval.heldout_per_family}
        source, what = python_source(t.env, {s: e.per_family or every[s] for s in splits}), t.env.python
    instances = [i for s in splits for i in source.instances(s)]
    agent = AnswerAgent() if e.agent == "oracle" else make_agent(e.agent) if e.agent != "model" else _model_agents(cfg)
    env = run_env(t.env, backend=None, images=None)  # type: ignore[arg-type]  # neither has a sandbox
    console.print(f"{len(instances)} instances of {what}, agent {e.agent}, {e.samples} sample(s) each")

    async def episodes():
        async with env.open() as opened:
            try:
                return await run_eval(
                    instances, agent, None, None, e.concurrency, e.out, console, e.samples, env=opened
                )
            finally:
                if close := getattr(agent, "close", None):
                    await close()

    return _report(asyncio.run(episodes()))


def _eval_openenv(cfg: Config) -> int:
    """eval.env=openenv: the server's instances of eval.split (eval.per_family of each family), one
    session each."""
    from furlong.build.openenv import openenv_environment, openenv_source
    from furlong.eval.agents import make_agent
    from furlong.eval.run import run_env_eval

    e = cfg.eval
    if e.agent == "oracle":
        raise ValueError("eval.env=openenv: an OpenEnv server has no oracle solutions; use --agent model or noop")
    specs, seen = [], dict[str | None, int]()
    for spec in openenv_source(cfg.openenv).instances(e.split):
        seen[spec.family] = seen.get(spec.family, 0) + 1
        if e.per_family is None or seen[spec.family] <= e.per_family:
            specs.append(spec)
    agent = make_agent(e.agent) if e.agent != "model" else _model_agents(cfg)
    console.print(
        f"{len(specs)} instances from {cfg.openenv.url}, agent {e.agent}, {e.samples} sample(s) each, "
        f"concurrency {e.concurrency}"
    )

    async def episodes():
        try:
            async with openenv_environment(cfg.openenv)() as env:
                return await run_env_eval(specs, agent, env, e.concurrency, e.out, console, e.samples)
        finally:
            if close := getattr(agent, "close", None):
                await close()

    return _report(asyncio.run(episodes()))


def _report(results) -> int:
    """An eval's table, then its JSON summary on stdout."""
    from furlong.eval.run import print_table, summarize

    print_table(results, console)
    print(json.dumps(summarize(results)))
    return 0


def _model_agents(cfg: Config):
    """--agent model: the engine over the checkpoint, built before any image so a bad one fails fast."""
    from furlong.build.evaluation import model_agents

    with console.status(f"loading {cfg.eval.model} ({cfg.eval.engine} engine)"):
        return model_agents(cfg)


async def _eval_episodes(cfg: Config, entries, agent, backend, store):
    """The eval's episodes; a model agent's engine is closed after them."""
    from furlong.build.environment import extra_tools, scorer
    from furlong.eval.run import run_eval

    e = cfg.eval
    try:
        return await run_eval(
            entries,
            agent,
            backend,
            store,
            e.concurrency,
            e.out,
            console,
            e.samples,
            extra_tools(cfg.train.env),
            scorer(cfg.train.env),
        )
    finally:
        if close := getattr(agent, "close", None):  # only the model agents hold an engine
            await close()
