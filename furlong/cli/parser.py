"""The `furlong` argument parser. Flags are shortcuts for config keys; any key can be set as key=value."""

from __future__ import annotations

import argparse
from pathlib import Path

from furlong.cli.audit import add_audit_parser
from furlong.cli.common import (
    add_common,
)
from furlong.cli.gateway import add_gateway_parser
from furlong.engine.serve_args import add_serve_arguments
from furlong.sandbox.base import Limits

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
    ev = sub.add_parser(
        "eval",
        help="run an agent on tasks, each in a fresh sandbox, and score it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=REPRODUCE_HELP,
    )
    ev.add_argument("--tasks", type=Path, help="a task, a task family, or a directory of them (eval.tasks)")
    ev.add_argument("--agent", choices=["oracle", "noop", "model"], help="eval.agent (model: --model DIR)")
    ev.add_argument("--model", type=Path, help="--agent model: a local Hugging Face checkpoint (eval.model)")
    ev.add_argument("--adapter", type=Path, help="--agent model: a PEFT adapter over --model (eval.adapter)")
    ev.add_argument("--engine", choices=["hf", "vllm"], help="--agent model: inference engine (eval.engine)")
    ev.add_argument("--samples", type=int, help="episodes per task; pass@k for powers of 2 up to it (eval.samples)")
    ev.add_argument("--temperature", type=float, help="--agent model: sampling temperature (eval.temperature)")
    ev.add_argument(
        "--seed", type=int, help="--agent model: sampling seeds derive from it, the task id and the sample (eval.seed)"
    )
    ev.add_argument("--concurrency", type=int, help="episodes at once (eval.concurrency)")
    ev.add_argument("--out", type=Path, help="write one JSON line per episode here (eval.out)")
    ev.add_argument("--split", choices=["train", "heldout", "all"], help="family instances to use (eval.split)")
    ev.add_argument("--per-family", type=int, help="instances per task family (eval.per_family)")
    ev.add_argument(
        "--verify-receipts",
        type=Path,
        metavar="FILE",
        help="run nothing: recheck the receipts of FILE (--out lines or a run's episodes.jsonl) against --tasks "
        "and the image store; exit 1 when a test or image changed (docs/audit.md#receipts)",
    )
    add_common(ev)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="furlong", description="RL post-training of LLM agents in real sandboxes")
    sub = parser.add_subparsers(dest="command", required=True)
    # in this order in `furlong --help`
    _eval_parser(sub)
    _train_parsers(sub)
    _model_parser(sub)
    _engine_parser(sub)
    _image_parser(sub)
    _report_parser(sub)
    _sandbox_parser(sub)
    _openenv_parser(sub)
    add_gateway_parser(sub)
    _tasks_parser(sub)
    add_audit_parser(sub)
    return parser


def _train_parsers(sub) -> None:
    tr = sub.add_parser("train", help="the whole loop: tiny model, SFT, GRPO in sandboxes, held-out eval")
    tr.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a killed run from its last checkpoint")
    tr.add_argument(
        "--require-update",
        action="store_true",
        help="exit 1 when no RL step updated the policy (for CI: a run that trained nothing)",
    )
    tr.add_argument(
        "--plan",
        type=Path,
        metavar="CLUSTER.yaml",
        help="dry run: print where each role would run, memory per rank, bytes per update; start nothing",
    )
    add_common(tr)
    sft = sub.add_parser("sft", help="only the warm-start: SFT on oracle demonstrations of the train tasks")
    add_common(sft)


def _model_parser(sub) -> None:
    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init", help="build a model offline (the embedded default: tiny)")
    init.add_argument(
        "name", help="tiny, or a tiny variant of a model family (qwen3, llama3, gpt_oss, ...: docs/models.md)"
    )
    init.add_argument("--out", type=Path, help="directory (default: the cache)")
    init.add_argument("--seed", type=int, default=0)


def _engine_parser(sub) -> None:
    eng = sub.add_parser("engine", help="inference engine utilities")
    eng_sub = eng.add_subparsers(dest="engine_command", required=True)
    add_serve_arguments(eng_sub.add_parser("serve", help="serve the hf engine over HTTP with a weight-sync relay"))


def _image_parser(sub) -> None:
    img = sub.add_parser("image", help="build or list sandbox images")
    img_sub = img.add_subparsers(dest="image_command", required=True)
    build = img_sub.add_parser("build", help="build the base image, and the images of --tasks if given")
    build.add_argument("--tasks", type=Path, help="also build every image these tasks need")
    add_common(build)
    ls = img_sub.add_parser("list", help="list built and imported images")
    add_common(ls)
    imp = img_sub.add_parser("import", help="load a rootfs directory or tarball, or an OCI image, under NAME")
    imp.add_argument("name", help="the name a Dockerfile's FROM will use, e.g. ubuntu:24.04")
    imp.add_argument("source", type=Path, help="a rootfs directory or tarball, an oci-archive tar, or an OCI layout")
    add_common(imp)
    pull = img_sub.add_parser("pull", help="pull REF from its registry (again, if cached) and print its digest")
    pull.add_argument("ref", help="an image reference, e.g. ghcr.io/org/img:1.2 or name@sha256:...")
    pull.add_argument("--platform", default="", help="os/arch[/variant] (default: this machine's)")
    add_common(pull)


def _report_parser(sub) -> None:
    rep = sub.add_parser("report", help="a run's report: report.md and a self-contained report.html with plots")
    rep.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="a run directory (finished or running)")
    rep.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/report)")
    rep.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="mean episode time A/B with a 90%% interval, and the difference per component",
    )
    rep.add_argument(
        "--project-inference-speedup",
        metavar="K,K",
        default="",
        help="projected episode and step time if inference were k times faster, e.g. 8,32",
    )


def _tasks_parser(sub) -> None:
    tk = sub.add_parser("tasks", help="task utilities")
    tk_sub = tk.add_subparsers(dest="tasks_command", required=True)
    swe = tk_sub.add_parser(
        "import-swe",
        help="SWE-bench-style instances (JSONL) into Harbor task directories, "
        "graded as SWE-bench grades them (docs/swe.md)",
    )
    swe.add_argument("instances", type=Path, metavar="INSTANCES.jsonl", help="one SWE-bench instance per line")
    swe.add_argument(
        "--repo-dir",
        type=Path,
        required=True,
        help="a local git repository holding every base_commit, or a directory of them as OWNER/NAME",
    )
    swe.add_argument("--out", type=Path, required=True, help="write one task directory per instance here")
    swe.add_argument(
        "--base-image",
        default=None,
        help="the images' FROM, with python3 and git (default debian:bookworm-slim: furlong's base)",
    )
    swe.add_argument(
        "--test-cmd",
        default=None,
        help="the test command, before the test files "
        "(default: swebench's 'pytest --no-header -rA --tb=no -p "
        "no:cacheprovider')",
    )


def _sandbox_parser(sub) -> None:
    sb = sub.add_parser("sandbox", help="sandbox host set-up")
    sb_sub = sb.add_subparsers(dest="sandbox_command", required=True)
    dg = sb_sub.add_parser("delegate", help="as root, once: give USER cgroups for per-sandbox limits")
    dg.add_argument("--user", required=True, help="the user who will run furlong")
    sb_sub.add_parser(
        "tidy",
        help="remove the sandbox cgroups dead furlong processes left; as root, also detach "
        "the image-layer views earlier versions left mounted (they slow every sandbox "
        "start), keeping the image store's own",
    )
    sv = sb_sub.add_parser("serve", help="serve sandboxes over HTTP (/v1) to other machines (docs/sandbox-hosts.md)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8790, help="port (default 8790)")
    sv.add_argument("--token-file", type=Path, help="file holding the bearer token (needed off loopback)")
    sv.add_argument("--capacity", type=int, default=8, help="most sandboxes at once; past it, 429 (default 8)")
    sv.add_argument("--idle-s", type=float, default=600.0, help="reap a sandbox unused this long (default 600)")
    sv.add_argument("--lifetime-s", type=float, default=3600.0, help="reap a sandbox this old (default 3600)")
    sv.add_argument(
        "--allow-network",
        action="store_true",
        help="give network to the sandboxes of tasks that declare it (default: refuse them)",
    )
    sv.add_argument(
        "--e2b-key-file",
        type=Path,
        help="also serve the E2B-compatible API (docs/e2b.md), clients sending the key in this file",
    )
    e2b = Limits()  # the E2B API names no limits: each of its sandboxes gets these (a /v1 create names its own)
    sv.add_argument("--e2b-cpus", type=float, default=e2b.cpus, help=f"each E2B sandbox's CPUs (default {e2b.cpus:g})")
    sv.add_argument(
        "--e2b-memory-mb", type=int, default=e2b.memory_mb, help=f"each E2B sandbox's memory (default {e2b.memory_mb})"
    )
    sv.add_argument(
        "--e2b-disk-mb",
        type=int,
        default=e2b.disk_mb,
        help=f"each E2B sandbox's writable layer (default {e2b.disk_mb})",
    )
    sv.add_argument("--e2b-pids", type=int, default=e2b.pids, help=f"each E2B sandbox's processes (default {e2b.pids})")
    add_common(sv)  # its sandboxes' and builds' settings: sandbox.*, images.* (e.g. images.trust_host_ca=true)


def _openenv_parser(sub) -> None:
    oe = sub.add_parser("openenv", help="OpenEnv environments (docs/openenv.md)")
    oe_sub = oe.add_subparsers(dest="openenv_command", required=True)
    sv = oe_sub.add_parser(
        "serve",
        help="serve furlong tasks as an OpenEnv environment: one sandbox per session, scored by the task's tests",
    )
    sv.add_argument("--tasks", type=Path, required=True, help="a task, a task family, or a directory of them")
    sv.add_argument(
        "--split",
        choices=["train", "heldout", "all"],
        default="all",
        help="which instances of task families to serve (default all)",
    )
    sv.add_argument("--per-family", type=int, help="instances of each family and split (default: all)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--token-file", type=Path, help="file holding the bearer token (needed off loopback)")
    sv.add_argument("--capacity", type=int, default=8, help="most sessions (sandboxes) at once (default 8)")
    sv.add_argument("--idle-s", type=float, default=600.0, help="reap a session unused this long (default 600)")
    sv.add_argument(
        "--allow-network",
        action="store_true",
        help="serve tasks that declare network, with network (default: refuse them)",
    )
    add_common(sv)
