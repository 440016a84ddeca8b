"""The `furlong` command: parses, dispatches to a subcommand, turns bad input into one line and exit 2."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from rich.console import Console

from furlong.cli.audit import cmd_audit
from furlong.cli.common import (
    build_base_image,
    config_of,
    console,
    print_error,
    quiet_library_bars,
    sandbox_pieces,
    warn_limits,
)
from furlong.cli.eval import cmd_eval
from furlong.cli.gateway import cmd_gateway
from furlong.cli.parser import build_parser
from furlong.cli.serve import cmd_openenv, cmd_sandbox
from furlong.config import REPO_ROOT, Config, ConfigError
from furlong.engine.base import EngineUnavailable
from furlong.sandbox.base import SandboxError


def cmd_image(args: argparse.Namespace) -> int:
    cfg = config_of(args, {})
    if cfg.sandbox.backend == "remote":  # the hosts build with their own stores (docs/sandbox-hosts.md)
        raise ConfigError(
            "furlong image works on this machine's image store; with sandbox.backend=remote the "
            "hosts build and keep the images: run it on a host"
        )
    backend, store = sandbox_pieces(cfg)
    if args.image_command == "list":
        for directory, what in store.listing():
            print(f"{directory}\t{what}")
        return 0
    if args.image_command == "import":
        from furlong.sandbox.images.imports import import_image

        with console.status(f"importing {args.source}") as status:
            meta = import_image(store.root, args.name, args.source, lambda msg: status.update(msg))
        console.print(
            f"imported {args.name} ({meta['kind']}, {meta['seconds']} s); a Dockerfile can now say FROM {args.name}"
        )
        return 0
    if args.image_command == "pull":
        with console.status(f"pulling {args.ref}") as status:
            meta = store.registry.image(args.ref, lambda msg: status.update(msg), refresh=True, platform=args.platform)
        print(f"{args.ref}\t{meta['digest']}")
        return 0
    build_base_image(store)
    console.print(f"base image: {store.root / store.base_key()}")
    if args.tasks:
        from furlong.eval.run import prepare_images
        from furlong.tasks.suite import load_tasks

        images = asyncio.run(
            prepare_images(load_tasks(args.tasks, split="all", backend=backend), store, backend, console)
        )
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
        config, moved = run.relocated_config(REPO_ROOT)
        for line in moved:
            console.print(f"resume: the run's checkout moved; {line}")
        return Config.model_validate(config), run
    path = cfg.train.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    return cfg, RunDir.create(path, cfg.model_dump(mode="json"), checkout=REPO_ROOT)


def _open_run(cfg: Config, args: argparse.Namespace):
    """The run directory, with the loggers train.log turns on (W&B)."""
    from furlong.build.training import attach_loggers

    cfg, run = _run_dir(cfg, args)
    attach_loggers(cfg.train, run)
    return cfg, run


def cmd_train(args: argparse.Namespace) -> int:
    if args.plan:
        return _plan(args.plan)
    quiet_library_bars()
    from furlong.run.driver import train

    warn_limits()
    cfg, run = _open_run(config_of(args, {}), args)
    console.print(f"run directory: {run.path}")
    try:
        summary = asyncio.run(train(cfg, run, console))
    finally:
        run.close()
    console.print(
        f"held-out pass@1: {summary['heldout_pass_at_1_before_rl']:.3f} after SFT -> "
        f"{summary['heldout_pass_at_1_after_rl']:.3f} after RL "
        f"({summary['improvement_points']:+.1f} points, {summary['eval_episodes']} episodes each, "
        f"temperature {summary['eval_temperature']})"
    )
    print(json.dumps(summary))
    return _no_update_verdict(summary, args.require_update)


def _no_update_verdict(summary: dict, required: bool) -> int:
    """A run whose RL steps all left the policy as it was trained nothing: say so in one line (every group
    had equal rewards, e.g. a model that never finishes a turn), and fail under --require-update."""
    if summary["rl_steps_updated"] or not summary["rl_steps"]:
        return 0
    console.print(
        f"[bold red]no RL step updated the policy[/] (0 of {summary['rl_steps']}: every group's rewards "
        "were equal); summary.json rl_steps_updated=0" + ("; --require-update: exit 1" if required else "")
    )
    return 1 if required else 0


def _plan(path: Path) -> int:
    from furlong.cluster.plan import make_plan
    from furlong.cluster.show import print_plan
    from furlong.cluster.spec import load_spec

    print_plan(make_plan(load_spec(path)), Console(width=132))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    quiet_library_bars()
    from furlong.build import training as build
    from furlong.run.phases import sft_phase

    warn_limits()
    cfg, run = _open_run(config_of(args, {}), args)
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
        raise ValueError(
            f"--project-inference-speedup: {args.project_inference_speedup!r} is not a list of numbers like 8,32"
        ) from None
    if any(k <= 0 for k in speedups):
        raise ValueError("--project-inference-speedup: every k must be > 0")
    written = report(args.run_dir, args.out, tuple(args.compare) if args.compare else None, speedups)
    for note in written.missing:
        console.print(f"[yellow]not in report:[/yellow] {note}", soft_wrap=True)
    console.print(f"{len(written.images)} plots; report: {written.out / 'report.md'} and {written.out / 'report.html'}")
    print(written.out / "report.html")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from furlong.model.families import family, init_family
    from furlong.model.tiny import init_tiny

    if args.name != "tiny":
        family(args.name)  # an unknown name fails here, naming the known ones, before anything is built
    with console.status(f"building the {args.name} model and tokenizer"):
        path = (
            init_tiny(args.out, seed=args.seed) if args.name == "tiny" else init_family(args.name, args.out, args.seed)
        )
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
    console.print(
        f"{len(written)} tasks in {args.out}; check them with `furlong eval --tasks {args.out}` "
        "(the oracle must resolve every one) and `--agent noop` (none)",
        soft_wrap=True,
    )
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from furlong.engine.server import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "eval": cmd_eval,
        "image": cmd_image,
        "train": cmd_train,
        "sft": cmd_sft,
        "model": cmd_model,
        "engine": cmd_engine,
        "sandbox": cmd_sandbox,
        "report": cmd_report,
        "openenv": cmd_openenv,
        "tasks": cmd_tasks,
        "gateway": cmd_gateway,
        "audit": cmd_audit,
    }
    try:
        return handlers[args.command](args)
    except (ConfigError, EngineUnavailable, ValueError, PermissionError, FileExistsError, FileNotFoundError) as exc:
        print_error(exc)  # bad input (a TaskError, a ModelLoadError...): the message names the key, file or path
        return 2
    except SandboxError as exc:  # an image build or sandbox start the host cannot do: its message says why
        print_error(exc)
        return 1
