"""Does reward rise when furlong trains through `furlong openenv serve`? Both hops on one machine:

  1. `furlong sft` with the default recipe's SFT (demonstrations of number-stats and transform-text);
  2. `furlong openenv serve --tasks tasks/number-words` (the family the default run learns from reward
     alone), with a token, on a free loopback port;
  3. `furlong train` with train.env.openenv=true from that SFT checkpoint: held-out pass@1 through the server,
     RL steps whose episodes are the server's sessions (scored by the task's tests there), held-out again;
  4. with --local, the same RL from the same checkpoint in sandboxes here (the default, Harbor tasks), on the same
     held-out instances with the same sampling seeds, for comparison.

Reported: held-out pass@1 before and after RL with the paired gain and its 90% bootstrap interval, the
RL reward per step and its first and second half, every status (infra errors included), phase seconds.
Writes bench/results/openenv_rl.json.

    python bench/openenv_rl.py --local              # about 25 min on 2 cores (SFT 7, each arm 7)
    python bench/openenv_rl.py --steps 2 --keep DIR # a check of this script (a finished SFT in DIR is reused)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from provenance import finish, provenance
from runs import ROOT, summary, train

from furlong.metrics.gains import heldout_gains

RESULTS = ROOT / "bench" / "results" / "openenv_rl.json"
FAMILY = "number-words"
TRAIN_INSTANCES = 128  # all of the family's train instances, served and drawn by RL


def serve(tasks: Path, token_file: Path, per_family: int, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "openenv", "serve", "--tasks", str(tasks),
                             "--per-family", str(per_family), "--port", str(port), "--token-file", str(token_file),
                             "--capacity", "32"], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(f"furlong openenv serve did not come up (see {log})")


def rewards(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["reward_mean"] for r in rows if r["phase"] == "rl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="RL steps (default 20)")
    ap.add_argument("--heldout", type=int, default=64, help="held-out instances evaluated (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local", action="store_true", help="also run the same RL locally (the default, Harbor tasks)")
    ap.add_argument("--keep", type=Path, help="work here and keep it (a finished SFT there is reused)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="openenv-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    sft_run = work / "sft"
    if not (sft_run / "checkpoints" / "sft" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "furlong.cli", "sft", f"train.run_dir={sft_run}",
                        f"train.seed={args.seed}"], cwd=ROOT, check=True)
    token = work / "token"
    token.write_text(secrets.token_urlsafe(24) + "\n")
    common = [f"train.model.path={sft_run / 'checkpoints' / 'sft'}", "train.sft.epochs=0", "train.rl.sft_coef=0",
              f"train.rl.steps={args.steps}", f"train.seed={args.seed}", "train.rl.tasks_per_step=8",
              "train.rl.group_size=8", "train.rl.concurrency=16", "train.rl.checkpoint_every=100",
              "train.eval.concurrency=16"]
    proc, url = serve(ROOT / "tasks" / FAMILY, token, TRAIN_INSTANCES, work / "serve.log")
    try:
        train([f"train.run_dir={work / 'openenv'}", "train.env.openenv=true", *common, f"openenv.url={url}",
               f"openenv.token_file={token}", f"openenv.instances={{train: {TRAIN_INSTANCES}, heldout: {args.heldout}}}"],
              label="rl through openenv serve")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    arms = {"openenv": arm(work / "openenv")}
    if args.local:  # the same RL with the same held-out instances and sampling seeds, in sandboxes here
        train([f"train.run_dir={work / 'local'}", f"train.families=[{FAMILY}]", *common,
               f"train.eval.heldout_per_family={args.heldout}"], label="rl locally")
        arms["local"] = arm(work / "local")
    result = {
        "question": "does reward rise when furlong trains through furlong openenv serve?",
        "family": FAMILY, "sft": "the default recipe's SFT (demonstrations of number-stats and transform-text)",
        "rl": {"steps": args.steps, "tasks_per_step": 8, "group_size": 8, "sft_coef": 0.0, "kl_coef": 0.05,
               "train_instances_served": TRAIN_INSTANCES, "heldout_instances": args.heldout},
        "arms": arms, "provenance": finish(prov),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({name: {k: a[k] for k in ("heldout_pass_at_1_before", "heldout_pass_at_1_after",
                                               "rl_reward_first_half", "rl_reward_second_half")}
                      for name, a in arms.items()}))


def arm(run: Path) -> dict:
    s, steps = summary(run), rewards(run)
    half = len(steps) // 2
    return {
        "heldout_pass_at_1_before": s["heldout_pass_at_1_before_rl"],
        "heldout_pass_at_1_after": s["heldout_pass_at_1_after_rl"],
        "heldout_gain": heldout_gains(run, {})["per_family"][FAMILY],
        "rl_reward_per_step": [round(r, 4) for r in steps],
        "rl_reward_first_half": round(sum(steps[:half]) / max(half, 1), 4),
        "rl_reward_second_half": round(sum(steps[half:]) / max(len(steps) - half, 1), 4),
        "status": s["status"], "eval_infra_errors": s["eval_infra_errors"], "rl_episodes": s["rl_episodes"],
        "phase_seconds": s["phase_seconds"],
    }


if __name__ == "__main__":
    main()
