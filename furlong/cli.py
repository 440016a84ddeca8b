"""The `furlong` command. Flags are shortcuts for config keys; any key can be set as key=value."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from furlong.config import Config, ConfigError, load_config
from furlong.engine.base import EngineUnavailable
from furlong.engine.serve_args import add_serve_arguments
from furlong.sandbox.base import SandboxError

console = Console(stderr=True)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="a YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. eval.concurrency=4")


REPRODUCE_HELP = """\
reproducing a training run's held-out pass@1 (eval_before: RUN/checkpoints/sft; eval_after:
RUN/checkpoints/rl-N/hf, the last step's) with the one runner and seed rule training uses:
  furlong eval --agent model --model RUN/checkpoints/rl-N/hf --tasks TRAIN_TASKS/FAMILY --split heldout
    --per-family <train.eval.heldout_per_family> --seed <train.eval.seed (1234)>
    --temperature <train.eval.temperature> --concurrency <train.eval.concurrency> --engine hf
    [the run's train.agent.* overrides]
one family per --tasks (or a directory holding only the run's families); the same concurrency keeps
the engine's batches, and so its sampled tokens, the same."""


def _eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="run an agent on tasks, each in a fresh sandbox, and score it",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=REPRODUCE_HELP)
    ev.add_argument("--tasks", type=Path, help="a task, a task family, or a directory of them (eval.tasks)")
    ev.add_argument("--agent", choices=["oracle", "noop", "model"], help="eval.agent (model: --model DIR)")
    ev.add_argument("--model", type=Path, help="--agent model: a local Hugging Face checkpoint (eval.model)")
    ev.add_argument("--adapter", type=Path, help="--agent model: a PEFT adapter over --model (eval.adapter)")
    ev.add_argument("--engine", choices=["hf", "vllm"], help="--agent model: inference engine (eval.engine)")
    ev.add_argument("--samples", type=int, help="episodes per task; pass@k for powers of 2 up to it (eval.samples)")
    ev.add_argument("--temperature", type=float, help="--agent model: sampling temperature (eval.temperature)")
    ev.add_argument("--seed", type=int, help="--agent model: sampling seeds derive from it, the task id and the "
                                             "sample (eval.seed)")
    ev.add_argument("--concurrency", type=int, help="episodes at once (eval.concurrency)")
    ev.add_argument("--out", type=Path, help="write one JSON line per episode here (eval.out)")
    ev.add_argument("--split", choices=["train", "heldout", "all"], help="family instances to use (eval.split)")
    ev.add_argument("--per-family", type=int, help="instances per task family (eval.per_family)")
    _common(ev)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="furlong", description="RL post-training of LLM agents in real sandboxes")
    sub = parser.add_subparsers(dest="command", required=True)

    _eval_parser(sub)

    tr = sub.add_parser("train", help="the whole loop: tiny model, SFT, GRPO in sandboxes, held-out eval")
    tr.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a killed run from its last checkpoint")
    tr.add_argument("--plan", type=Path, metavar="CLUSTER.yaml",
                    help="dry run: print where each role would run, memory per rank, bytes per update; start nothing")
    _common(tr)
    sft = sub.add_parser("sft", help="only the warm-start: SFT on oracle demonstrations of the train tasks")
    _common(sft)

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="build a model offline (the embedded default: tiny)")
    init.add_argument("name", choices=["tiny"])
    init.add_argument("--out", type=Path, help="directory (default: the cache)")
    init.add_argument("--seed", type=int, default=0)

    eng = sub.add_parser("engine", help="inference engine utilities")
    eng_sub = eng.add_subparsers(dest="engine_command", required=True)
    add_serve_arguments(eng_sub.add_parser("serve", help="serve the hf engine over HTTP with a weight-sync relay"))

    img = sub.add_parser("image", help="build or list sandbox images")
    img_sub = img.add_subparsers(dest="image_command", required=True)
    build = img_sub.add_parser("build", help="build the base image, and the images of --tasks if given")
    build.add_argument("--tasks", type=Path, help="also build every image these tasks need")
    _common(build)
    ls = img_sub.add_parser("list", help="list built and imported images")
    _common(ls)
    imp = img_sub.add_parser("import", help="load a rootfs directory or tarball, or an OCI image, under NAME")
    imp.add_argument("name", help="the name a Dockerfile's FROM will use, e.g. ubuntu:24.04")
    imp.add_argument("source", type=Path, help="a rootfs directory or tarball, an oci-archive tar, or an OCI layout")
    _common(imp)
    pull = img_sub.add_parser("pull", help="pull REF from its registry (again, if cached) and print its digest")
    pull.add_argument("ref", help="an image reference, e.g. ghcr.io/org/img:1.2 or name@sha256:...")
    pull.add_argument("--platform", default="", help="os/arch[/variant] (default: this machine's)")
    _common(pull)

    rep = sub.add_parser("report", help="a run's report: report.md and a self-contained report.html with plots")
    rep.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="a run directory (finished or running)")
    rep.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/report)")
    rep.add_argument("--compare", type=Path, nargs=2, metavar=("RUN_A", "RUN_B"),
                     help="mean episode time A/B with a 90%% interval, and the difference per component")
    rep.add_argument("--project-inference-speedup", metavar="K,K", default="",
                     help="projected episode and step time if inference were k times faster, e.g. 8,32")

    _sandbox_parser(sub)
    _openenv_parser(sub)
    _tasks_parser(sub)
    return parser


def _tasks_parser(sub) -> None:
    tk = sub.add_parser("tasks", help="task utilities")
    tk_sub = tk.add_subparsers(dest="tasks_command", required=True)
    swe = tk_sub.add_parser("import-swe", help="SWE-bench-style instances (JSONL) into Harbor task directories, "
                                               "graded as SWE-bench grades them (docs/swe.md)")
    swe.add_argument("instances", type=Path, metavar="INSTANCES.jsonl", help="one SWE-bench instance per line")
    swe.add_argument("--repo-dir", type=Path, required=True,
                     help="a local git repository holding every base_commit, or a directory of them as OWNER/NAME")
    swe.add_argument("--out", type=Path, required=True, help="write one task directory per instance here")
    swe.add_argument("--base-image", default=None,
                     help="the images' FROM, with python3 and git (default debian:bookworm-slim: furlong's base)")
    swe.add_argument("--test-cmd", default=None, help="the test command, before the test files "
                                                      "(default: swebench's 'pytest --no-header -rA --tb=no -p "
                                                      "no:cacheprovider')")


def _sandbox_parser(sub) -> None:
    sb = sub.add_parser("sandbox", help="sandbox host set-up")
    sb_sub = sb.add_subparsers(dest="sandbox_command", required=True)
    dg = sb_sub.add_parser("delegate", help="as root, once: give USER cgroups for per-sandbox limits")
    dg.add_argument("--user", required=True, help="the user who will run furlong")
    sb_sub.add_parser("tidy", help="remove the sandbox cgroups dead furlong processes left; as root, also detach "
                                   "the image-layer views earlier versions left mounted (they slow every sandbox "
                                   "start), keeping the image store's own")
    sv = sb_sub.add_parser("serve", help="serve sandboxes over HTTP (/v1) to other machines (docs/sandbox-hosts.md)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8790, help="port (default 8790)")
    sv.add_argument("--token-file", type=Path, help="file holding the bearer token (needed off loopback)")
    sv.add_argument("--capacity", type=int, default=8, help="most sandboxes at once; past it, 429 (default 8)")
    sv.add_argument("--idle-s", type=float, default=600.0, help="reap a sandbox unused this long (default 600)")
    sv.add_argument("--lifetime-s", type=float, default=3600.0, help="reap a sandbox this old (default 3600)")
    sv.add_argument("--allow-network", action="store_true",
                    help="give network to the sandboxes of tasks that declare it (default: refuse them)")
    sv.add_argument("--e2b-key-file", type=Path,
                    help="also serve the E2B-compatible API (docs/e2b.md), clients sending the key in this file")
    _common(sv)  # its sandboxes' and builds' settings: sandbox.*, images.* (e.g. images.trust_host_ca=true)


def _openenv_parser(sub) -> None:
    oe = sub.add_parser("openenv", help="OpenEnv environments (docs/openenv.md)")
    oe_sub = oe.add_subparsers(dest="openenv_command", required=True)
    sv = oe_sub.add_parser("serve", help="serve furlong tasks as an OpenEnv environment: one sandbox per session, "
                                         "scored by the task's tests")
    sv.add_argument("--tasks", type=Path, required=True, help="a task, a task family, or a directory of them")
    sv.add_argument("--split", choices=["train", "heldout", "all"], default="all",
                    help="which instances of task families to serve (default all)")
    sv.add_argument("--per-family", type=int, help="instances of each family and split (default: all)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--token-file", type=Path, help="file holding the bearer token (needed off loopback)")
    sv.add_argument("--capacity", type=int, default=8, help="most sessions (sandboxes) at once (default 8)")
    sv.add_argument("--idle-s", type=float, default=600.0, help="reap a session unused this long (default 600)")
    sv.add_argument("--allow-network", action="store_true",
                    help="serve tasks that declare network, with network (default: refuse them)")
    _common(sv)


def _config(args: argparse.Namespace, flags: dict[str, str]) -> Config:
    overrides = list(args.overrides)
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(str(value)) if isinstance(value, Path) else value}")
    return load_config(args.config, overrides)


def _sandbox_pieces(cfg: Config):
    from furlong.build import sandbox as build

    _warn_limits()
    store = build.image_store(cfg.sandbox, cfg.images)
    return build.sandbox_backend(cfg.sandbox, store), store


def _warn_limits() -> None:
    """One line at start when, as an ordinary user, sandboxes will have only rlimits."""
    from furlong.sandbox.cgroups import no_cgroup_warning

    if warning := no_cgroup_warning():
        console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)


def _base_image(store) -> None:
    """Builds (or finds) the base image up front, so a missing prerequisite is one line, not N episodes."""
    with console.status("building base image") as status:
        store.base(lambda msg: status.update(msg))


def cmd_eval(args: argparse.Namespace) -> int:
    from furlong.eval.agents import make_agent
    from furlong.eval.model import check_model_flags
    from furlong.eval.run import print_table, summarize
    from furlong.tasks.suite import load_suite

    cfg = _config(args, {"tasks": "eval.tasks", "agent": "eval.agent", "concurrency": "eval.concurrency",
                         "out": "eval.out", "split": "eval.split", "per_family": "eval.per_family",
                         "model": "eval.model", "adapter": "eval.adapter", "engine": "eval.engine",
                         "samples": "eval.samples", "temperature": "eval.temperature", "seed": "eval.seed"})
    e = cfg.eval
    check_model_flags(e)
    if cfg.train.env.python is not None or cfg.train.env.prompts.active:
        return _own_env_eval(cfg)
    if e.env == "openenv":
        return _eval_openenv(cfg)
    backend, store = _sandbox_pieces(cfg)  # family generators run on the configured backend too
    suite = load_suite(e.tasks, split=e.split, per_family=e.per_family, backend=backend)
    agent = make_agent(e.agent) if e.agent != "model" else _model_agents(cfg)
    if e.verifier_toolchain:
        from furlong.sandbox.toolchain import opt_in_all

        suite = type(suite)(opt_in_all(suite.entries))
    for broken in suite.broken:  # each is also an infra_error line in --out and the table
        console.print(f"[yellow]not loaded:[/yellow] {broken.error}", soft_wrap=True)
    _base_image(store)
    console.print(f"{len(suite.tasks)} tasks ({len(suite.broken)} not loaded) from {e.tasks}, agent {e.agent}, "
                  f"{e.samples} sample(s) each, concurrency {e.concurrency}")
    results = asyncio.run(_eval_episodes(cfg, suite.entries, agent, backend, store))
    print_table(results, console)
    print(json.dumps(summarize(results)))
    return 0


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
            raise ConfigError("--agent oracle answers a prompt row's reference answer: set "
                              "train.env.prompts.answer_field, or use --agent noop or model")
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
                return await run_eval(instances, agent, None, None, e.concurrency, e.out, console, e.samples,
                                      env=opened)
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
    specs, seen = [], {}
    for spec in openenv_source(cfg.openenv).instances(e.split):
        seen[spec.family] = seen.get(spec.family, 0) + 1
        if e.per_family is None or seen[spec.family] <= e.per_family:
            specs.append(spec)
    agent = make_agent(e.agent) if e.agent != "model" else _model_agents(cfg)
    console.print(f"{len(specs)} instances from {cfg.openenv.url}, agent {e.agent}, {e.samples} sample(s) each, "
                  f"concurrency {e.concurrency}")

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
        return await run_eval(entries, agent, backend, store, e.concurrency, e.out, console, e.samples,
                              extra_tools(cfg.train.env), scorer(cfg.train.env))
    finally:
        if close := getattr(agent, "close", None):  # only the model agents hold an engine
            await close()


def cmd_image(args: argparse.Namespace) -> int:
    cfg = _config(args, {})
    if cfg.sandbox.backend == "remote":  # the hosts build with their own stores (docs/sandbox-hosts.md)
        raise ConfigError("furlong image works on this machine's image store; with sandbox.backend=remote the "
                          "hosts build and keep the images: run it on a host")
    backend, store = _sandbox_pieces(cfg)
    if args.image_command == "list":
        for directory, what in store.listing():
            print(f"{directory}\t{what}")
        return 0
    if args.image_command == "import":
        from furlong.sandbox.imports import import_image

        with console.status(f"importing {args.source}") as status:
            meta = import_image(store.root, args.name, args.source, lambda msg: status.update(msg))
        console.print(f"imported {args.name} ({meta['kind']}, {meta['seconds']} s); a Dockerfile can now say "
                      f"FROM {args.name}")
        return 0
    if args.image_command == "pull":
        with console.status(f"pulling {args.ref}") as status:
            meta = store.registry.image(args.ref, lambda msg: status.update(msg), refresh=True, platform=args.platform)
        print(f"{args.ref}\t{meta['digest']}")
        return 0
    _base_image(store)
    console.print(f"base image: {store.root / store.base_key()}")
    if args.tasks:
        from furlong.eval.run import prepare_images
        from furlong.tasks.suite import load_tasks

        images = asyncio.run(prepare_images(load_tasks(args.tasks, split="all", backend=backend), store, backend,
                                            console))
        failed = [v for v in images.values() if isinstance(v, str)]
        console.print(f"{len(images) - len(failed)} task images ready, {len(failed)} failed")
        return 1 if failed else 0
    return 0


def _run_dir(cfg: Config, args: argparse.Namespace):
    import time

    from furlong.metrics.run import RunDir

    if getattr(args, "resume", None):
        if args.overrides or args.config:
            raise ConfigError("--resume continues a run with its own config; drop the overrides")
        run = RunDir.open(args.resume)
        return Config.model_validate(run.config()), run
    path = cfg.train.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    return cfg, RunDir.create(path, cfg.model_dump(mode="json"))


def _open_run(cfg: Config, args: argparse.Namespace):
    """The run directory, with the loggers train.log turns on (W&B)."""
    from furlong.build.training import attach_loggers

    cfg, run = _run_dir(cfg, args)
    attach_loggers(cfg.train, run)
    return cfg, run


def cmd_sandbox(args: argparse.Namespace) -> int:
    from furlong.sandbox.cgroups import delegate

    if args.sandbox_command == "tidy":
        return _tidy()
    if args.sandbox_command == "serve":
        return _serve(args)
    for d in delegate(args.user):
        print(d)
    console.print(f"{args.user} now gets per-sandbox cgroup limits when running furlong")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from furlong.paths import cache_dir
    from furlong.sandbox.host.serve import e2b_key, host_token, serve

    if args.capacity < 1:
        raise SandboxError(f"--capacity: expected at least 1, got {args.capacity}")
    token = host_token(args.token_file, args.host, cache_dir() / "host-token", console.print)
    key = None if args.e2b_key_file is None else e2b_key(args.e2b_key_file)
    cfg = _config(args, {})
    if cfg.sandbox.backend != "bwrap":
        raise SandboxError(f"sandbox.backend={cfg.sandbox.backend}: a host serves its own (bwrap) sandboxes")
    backend, store = _sandbox_pieces(cfg)
    serve(backend, store, token, host=args.host, port=args.port, capacity=args.capacity, idle_s=args.idle_s,
          lifetime_s=args.lifetime_s, say=console.print, e2b_api_key=key, allow_network=args.allow_network)
    return 0


def _tidy() -> int:
    from furlong.paths import cache_dir
    from furlong.sandbox import cgroups, layers
    from furlong.sandbox.base import DEFAULT_HOST_UID

    console.print(f"removed {cgroups.sweep_dead()} sandbox cgroups that dead furlong processes left")
    if not layers.supported():  # an ordinary user's sandboxes use the layers directly
        console.print("no image-layer views to detach: only root's sandboxes use them")
        return 0
    keep = layers.mount_point(cache_dir() / "images", DEFAULT_HOST_UID)  # the view sandboxes use by default
    with console.status("detaching image-layer views"):
        n = layers.detach_all_but(keep)
    console.print(f"detached {n} image-layer views; kept the image store's own ({keep})")
    return 0


def cmd_openenv(args: argparse.Namespace) -> int:
    from furlong.eval.openenv_app import serve
    from furlong.paths import cache_dir
    from furlong.sandbox.host.serve import host_token
    from furlong.sandbox.pool import FreshSandboxes, StoreImages
    from furlong.tasks.suite import load_suite

    if args.capacity < 1:
        raise ValueError(f"--capacity: expected at least 1, got {args.capacity}")
    token = host_token(args.token_file, args.host, cache_dir() / "openenv-token", console.print)
    backend, store = _sandbox_pieces(_config(args, {}))
    suite = load_suite(args.tasks, split=args.split, per_family=args.per_family, backend=backend)
    for broken in suite.broken:
        console.print(f"[yellow]not served:[/yellow] {broken.error}", soft_wrap=True)
    _base_image(store)
    serve(suite.tasks, FreshSandboxes(backend, StoreImages(store, backend)), token, host=args.host, port=args.port,
          capacity=args.capacity, idle_s=args.idle_s, allow_network=args.allow_network, say=console.print)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.plan:
        return _plan(args.plan)
    from furlong.run.driver import train

    _warn_limits()
    cfg, run = _open_run(_config(args, {}), args)
    console.print(f"run directory: {run.path}")
    try:
        summary = asyncio.run(train(cfg, run, console))
    finally:
        run.close()
    console.print(f"held-out pass@1: {summary['heldout_pass_at_1_before_rl']:.3f} after SFT -> "
                  f"{summary['heldout_pass_at_1_after_rl']:.3f} after RL "
                  f"({summary['improvement_points']:+.1f} points, {summary['eval_episodes']} episodes each, "
                  f"temperature {summary['eval_temperature']})")
    print(json.dumps(summary))
    return 0


def _plan(path: Path) -> int:
    from furlong.cluster.plan import make_plan
    from furlong.cluster.show import print_plan
    from furlong.cluster.spec import load_spec

    print_plan(make_plan(load_spec(path)), Console(width=132))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from furlong.build import training as build
    from furlong.run.phases import sft_phase

    _warn_limits()
    cfg, run = _open_run(_config(args, {}), args)
    pieces = build.pieces(cfg)
    try:
        out = asyncio.run(sft_phase(cfg, pieces, run, console))
    finally:
        pieces.close()
        run.close()
    console.print(f"SFT model: {out}")
    print(json.dumps(run.phase("sft")))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from furlong.report.build import report

    if args.run_dir is None and args.compare is None:
        raise ValueError("furlong report needs RUN_DIR, or --compare RUN_A RUN_B")
    try:
        speedups = [float(k) for k in args.project_inference_speedup.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--project-inference-speedup: {args.project_inference_speedup!r} is not a list "
                         "of numbers like 8,32") from None
    if any(k <= 0 for k in speedups):
        raise ValueError("--project-inference-speedup: every k must be > 0")
    written = report(args.run_dir, args.out, tuple(args.compare) if args.compare else None, speedups)
    for note in written.missing:
        console.print(f"[yellow]not in report:[/yellow] {note}", soft_wrap=True)
    console.print(f"{len(written.images)} plots; report: {written.out / 'report.md'} and {written.out / 'report.html'}")
    print(written.out / "report.html")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from furlong.model.tiny import init_tiny

    with console.status("building the tiny model and tokenizer"):
        path = init_tiny(args.out, seed=args.seed)
    print(path)
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    import dataclasses

    from furlong.tasks.swe import ImportOptions, import_instances

    given = {"base_image": args.base_image, "test_cmd": args.test_cmd}
    options = dataclasses.replace(ImportOptions(), **{k: v for k, v in given.items() if v is not None})
    with console.status(f"importing {args.instances}"):
        written = import_instances(args.instances, args.repo_dir, args.out, options)
    for task in written:
        print(task)
    console.print(f"{len(written)} tasks in {args.out}; check them with `furlong eval --tasks {args.out}` "
                  "(the oracle must resolve every one) and `--agent noop` (none)", soft_wrap=True)
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from furlong.engine.server import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"eval": cmd_eval, "image": cmd_image, "train": cmd_train, "sft": cmd_sft, "model": cmd_model,
                "engine": cmd_engine, "sandbox": cmd_sandbox, "report": cmd_report, "openenv": cmd_openenv,
                "tasks": cmd_tasks}
    try:
        return handlers[args.command](args)
    except (ConfigError, EngineUnavailable, ValueError, PermissionError, FileExistsError, FileNotFoundError) as exc:
        _error(exc)  # bad input (a TaskError, a ModelLoadError...): the message names the key, file or path
        return 2
    except SandboxError as exc:  # an image build or sandbox start the host cannot do: its message says why
        _error(exc)
        return 1


def _error(exc: BaseException) -> None:
    # escaped: messages quote values such as [1 or [a, b] that rich would read as markup and drop
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
