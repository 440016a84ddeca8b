"""What the training benches share: running `furlong train` as a user would, forking a run before its
RL phase, and reading a finished run's held-out results and stability figures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from furlong.metrics.episodes import read_jsonl  # noqa: E402


class TrainFailed(RuntimeError):
    pass


def train(args: list[str], label: str = "") -> None:
    """One `furlong train` in a subprocess; raises TrainFailed with the end of its stderr."""
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", *args], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if res.returncode != 0:
        raise TrainFailed(f"furlong train {label} failed:\n{res.stderr[-3000:]}")


def fork_before_rl(src: Path, dst: Path, overrides: dict) -> None:
    """A copy of run `src` that has done SFT and the pre-RL eval, with RL settings changed."""
    dst.mkdir(parents=True)
    config = yaml.safe_load((src / "config.yaml").read_text())
    config["train"]["rl"].update(overrides)
    config["train"]["run_dir"] = str(dst)
    (dst / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    state = json.loads((src / "state.json").read_text())
    state["phases"] = {k: v for k, v in state["phases"].items() if k in ("sft", "eval_before")}
    state["last_checkpoint"] = None
    (dst / "state.json").write_text(json.dumps(state))
    for name, keep in (("metrics.jsonl", "sft"), ("episodes.jsonl", "eval_before")):
        rows = [r for r in read_jsonl(src / name) if r["phase"] == keep]
        (dst / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if (src / "demos.jsonl").exists():  # the demonstration anchor (rl.sft_coef) trains on SFT's own demos
        shutil.copy2(src / "demos.jsonl", dst / "demos.jsonl")


def fork_with_own_eval(src: Path, dst: Path, sft: Path, overrides: dict) -> None:
    """fork_before_rl, from the SFT checkpoint `sft` (copied in) and with no pre-RL eval: the fork runs its own
    (src's held-out episodes were of another checkpoint or another agent)."""
    fork_before_rl(src, dst, overrides)
    shutil.copytree(sft, dst / "checkpoints" / "sft")
    state = json.loads((dst / "state.json").read_text())
    state["phases"] = {"sft": {**state["phases"]["sft"], "model": str(dst / "checkpoints" / "sft")}}
    (dst / "state.json").write_text(json.dumps(state))
    (dst / "episodes.jsonl").write_text("")


def heldout(run: Path, phase: str) -> dict[str, dict]:
    """A finished run's scored held-out episodes of `phase` (eval_before, eval_after), by task."""
    return {r["task"]: r for r in read_jsonl(run / "episodes.jsonl") if r["phase"] == phase and r["reward"] is not None}


def ci(est, scale: float = 1.0) -> list[float]:
    """An Estimate as [value, 90% low, high], rounded for a result JSON (scale 100: points)."""
    return [round(scale * est.value, 4), round(scale * est.lo, 4), round(scale * est.hi, 4)]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def stability(run: Path) -> dict:
    """Entropy and train reward over the RL steps: "bounded" = the last third's mean entropy is at most
    1.25x the first third's; "holds" = the second half's mean train reward is at least the first half's."""
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    ent, rew = [r["entropy"] for r in rows], [r["reward_mean"] for r in rows]
    third, half = max(len(rows) // 3, 1), len(rows) // 2
    first, last = _mean(ent[:third]), _mean(ent[-third:])
    return {"steps": len(rows), "entropy_first_third": round(first, 4), "entropy_last_third": round(last, 4),
            "entropy_max": round(max(ent, default=float("nan")), 4),
            "entropy_bounded": bool(last <= 1.25 * first),
            "reward_first_half": round(_mean(rew[:half]), 4), "reward_second_half": round(_mean(rew[half:]), 4),
            "reward_holds": bool(_mean(rew[half:]) >= _mean(rew[:half]))}
