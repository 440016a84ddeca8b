"""summary.json and the RL phase's totals, read back from the run directory's records."""

from __future__ import annotations

from pathlib import Path

from furlong.agent.runner import STATUSES
from furlong.config import Config
from furlong.metrics.gains import heldout_gains
from furlong.metrics.run import RunDir
from furlong.rollout.scheduler import OUTCOMES


def rl_totals(run: RunDir) -> dict:
    """Summed over the logged steps, so time spent before a kill and resume is counted once."""
    rows = run.metrics("rl")
    episodes = {k: sum(row.get(f"episodes_{k}", 0) for row in rows) for k in ("started", *OUTCOMES)}
    # stopped by rl.time_budget_s: episodes still running or untrained then are cancelled, never trained
    episodes["cancelled_at_stop"] = rows[-1].get("episodes_in_flight", 0) if rows else 0
    return {
        "steps": len(rows),
        "seconds": sum(row["step_seconds"] for row in rows),
        "status": {k: sum(row.get(f"status_{k}", 0) for row in rows) for k in STATUSES},
        "episodes": episodes,
    }


def _phase_status(result: dict) -> dict[str, int]:
    """Every status of a phase's episodes (zeros for a phase recorded before statuses were kept)."""
    return {k: result.get("status", {}).get(k, 0) for k in STATUSES}


def run_summary(cfg: Config, run: RunDir, before: dict, after: dict, wall_s: float, final: Path) -> dict:
    """Held-out pass@1 before and after RL, the paired gain per family and per group (reward-only,
    demonstrated) with 90% intervals, every status, where the time went, the final model."""
    phases, t = run.state()["phases"], cfg.train
    return {
        "run_dir": str(run.path),
        "hf_model": str(final),
        "hf_adapter": str(final / "adapter") if (final / "adapter").is_dir() else None,
        "heldout_pass_at_1_before_rl": before["pass_at_1"],
        "heldout_pass_at_1_after_rl": after["pass_at_1"],
        "improvement_points": 100 * (after["pass_at_1"] - before["pass_at_1"]),
        "eval_episodes": after["episodes"],
        "eval_temperature": t.eval.temperature,
        "eval_infra_errors": before["infra_errors"] + after["infra_errors"],
        "per_family_before": before["per_family"],
        "per_family_after": after["per_family"],
        "seed": t.seed,
        "demonstrated_families": list(t.demonstrated()),
        "reward_only_families": list(t.reward_only()),
        "heldout_gain": heldout_gains(run.path, {"reward_only": t.reward_only(), "demonstrated": t.demonstrated()}),
        "status": {name: _phase_status(phases[name]) for name in ("eval_before", "rl", "eval_after")},
        "rl_steps": t.rl.steps,
        "rl_steps_updated": sum(bool(row.get("updated")) for row in run.metrics("rl")),
        "rl_mode": t.rl.mode,
        "rl_episodes": phases["rl"].get("episodes", {}),
        "families": list(t.families),
        "phase_seconds": {
            name: round(phases[name]["seconds"], 1) for name in ("sft", "eval_before", "rl", "eval_after")
        },
        "wall_seconds_this_invocation": round(wall_s, 1),
    }
