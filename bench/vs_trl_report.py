"""Summaries, ratios and the printed table of bench/vs_trl.py (kept apart so each file reads in one go)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

TARGET_SPEEDUP = 1.5


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize_round(run: dict[str, Any], a: argparse.Namespace, eval_r: float) -> dict[str, Any]:
    steps = run["steps"]
    rewards = [s["reward"] for s in steps]
    return {"setup_s": run["setup_s"], "wall_s": run["wall_s"], "steps_run": len(steps),
            "first_step_s": steps[0]["seconds"] if steps else None,
            "step_s_mean": _mean([s["seconds"] for s in steps[a.warmup:]]),
            "reward_first3": _mean(rewards[:3]), "reward_last": _mean(rewards[-a.tail:]), "reward_eval": eval_r}


def summarize(rounds: list[dict[str, Any]], side: str, a: argparse.Namespace) -> dict[str, Any]:
    """Times pooled over every round's post-warm-up steps; rewards averaged over rounds."""
    steps = [s for r in rounds for s in r[side]["steps"][a.warmup:]]
    timed = [s["seconds"] for s in steps]
    per_round = [r[side]["summary"] for r in rounds]
    out: dict[str, Any] = {
        "steps_timed": len(timed),
        "step_s_mean": _mean(timed), "step_s_median": statistics.median(timed) if timed else None,
        "step_s_min": min(timed, default=None), "step_s_max": max(timed, default=None),
        "first_step_s": _mean([p["first_step_s"] for p in per_round if p["first_step_s"] is not None]),
        "setup_s": _mean([p["setup_s"] for p in per_round]),
        "completion_len_last": _mean([s["completion_len"] for r in rounds for s in r[side]["steps"][-a.tail:]]),
    }
    for phase in ("generate_s", "other_s", "train_s", "sync_s"):
        xs = [s[phase] for s in steps if phase in s]
        if len(xs) == len(steps) and xs:
            out[f"{phase[:-2]}_s_mean"] = statistics.fmean(xs)
    for key in ("reward_first3", "reward_last", "reward_eval"):
        values = [p[key] for p in per_round]
        out[key] = _mean(values)
        out[f"{key}_per_round"] = values
    return out


def ratios(f: dict[str, Any], t: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    per_round = [r["trl"]["summary"]["step_s_mean"] / r["furlong"]["summary"]["step_s_mean"] for r in rounds]
    out = {"speedup_mean": t["step_s_mean"] / f["step_s_mean"],
           "speedup_median": t["step_s_median"] / f["step_s_median"],
           "speedup_first_step": t["first_step_s"] / f["first_step_s"],
           "speedup_per_round": per_round,
           "reward_last_diff": f["reward_last"] - t["reward_last"],
           "reward_eval_diff": f["reward_eval"] - t["reward_eval"],
           "reward_last_ratio": f["reward_last"] / t["reward_last"] if t["reward_last"] else None,
           "reward_eval_ratio": f["reward_eval"] / t["reward_eval"] if t["reward_eval"] else None}
    if "generate_s_mean" in f and "generate_s_mean" in t:
        out["speedup_generate"] = t["generate_s_mean"] / f["generate_s_mean"]
        out["speedup_other"] = t["other_s_mean"] / f["other_s_mean"]
    return out


def print_report(console: Console, result: dict[str, Any]) -> None:
    a, s, r = result["config"], result["summary"], result.get("ratios")
    env = result["environment"]
    console.print(f"[bold]furlong vs TRL {env['trl']} GRPOTrainer[/bold]: {a['rounds']} round(s) x {a['steps']} steps "
                  f"x {a['prompts_per_step']} prompts x {a['group_size']} samples, <= {a['max_completion_length']} "
                  f"new tokens, lr {a['lr']}, {env['model_params'] / 1e6:.1f}M-param Qwen3, CPU fp32, "
                  f"torch.set_num_threads({a['threads']}) for both (threads seen: {env['threads_seen']}); "
                  f"torch {env['torch']}, transformers {env['transformers']}; {env['cpu_count']} CPUs, load avg "
                  f"{env['loadavg_start'][0]:.1f} at start")
    sides = [k for k in ("furlong", "trl") if k in s]
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    for k in sides:
        table.add_column("furlong" if k == "furlong" else "TRL", justify="right")
    if r:
        table.add_column("ratio", justify="right")

    def fmt(x: Any, unit: str = "") -> str:
        if x is None:
            return "-"
        if isinstance(x, list):
            return " ".join(f"{v:.3f}" for v in x)
        return f"{x:.3f}{unit}" if isinstance(x, float) else f"{x}{unit}"

    def speed(key: str) -> str | None:
        return f"{r[key]:.2f}x" if r and key in r else None

    tail = a["tail"]
    rows = [
        (f"time/step, mean (after {a['warmup']} warm-up)", "step_s_mean", "s", speed("speedup_mean")),
        ("time/step, median", "step_s_median", "s", speed("speedup_median")),
        ("time/step, min..max", None, "", None),
        ("  generation", "generate_s_mean", "s", speed("speedup_generate")),
        ("  the rest: score, train, sync, log", "other_s_mean", "s", speed("speedup_other")),
        ("    furlong train_step", "train_s_mean", "s", None),
        ("    furlong weight push to engine", "sync_s_mean", "s", None),
        ("first step (warm-up)", "first_step_s", "s", speed("speedup_first_step")),
        ("setup (not timed)", "setup_s", "s", None),
        ("reward, first 3 steps", "reward_first3", "", None),
        (f"reward, last {tail} steps", "reward_last", "", r and f"{r['reward_last_diff']:+.3f}"),
        ("  per round", "reward_last_per_round", "", None),
        ("reward, final weights, held-out", "reward_eval", "", r and f"{r['reward_eval_diff']:+.3f}"),
        ("  per round", "reward_eval_per_round", "", None),
        (f"completion length, last {tail} steps", "completion_len_last", "", None),
    ]
    for label, key, unit, ratio in rows:
        if key is None:
            cells = [f"{s[k]['step_s_min']:.2f}..{s[k]['step_s_max']:.2f}s" for k in sides]
        elif any(s[k].get(key) is not None for k in sides):
            cells = [fmt(s[k].get(key), unit) for k in sides]
        else:
            continue
        table.add_row(label, *cells, *([ratio or ""] if r else []))
    if r and len(r["speedup_per_round"]) > 1:
        table.add_row("time/step, per round", *[""] * len(sides), " ".join(f"{x:.2f}x" for x in r["speedup_per_round"]))
    console.print(table)
    if r:
        console.print("ratio: times are TRL / furlong (> 1: furlong faster); rewards are furlong - TRL")
    if r:
        ok_speed = r["speedup_mean"] >= TARGET_SPEEDUP
        ok_reward = r["reward_eval_diff"] >= 0 and r["reward_last_diff"] >= 0
        console.print(f"target (>= {TARGET_SPEEDUP}x per step at equal or better reward): speed "
                      f"{'met' if ok_speed else 'NOT met'} ({r['speedup_mean']:.2f}x); reward "
                      f"{'equal or better' if ok_reward else 'lower on at least one measure'} "
                      f"(last steps {r['reward_last_diff']:+.3f}, held-out {r['reward_eval_diff']:+.3f}; "
                      "compare with the spread across rounds before reading much into it)")
    if "trl" in s:
        console.print(f"TRL prompt ids identical to furlong's in every round: {result.get('trl_prompts_match')}")
