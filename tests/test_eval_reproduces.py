"""`furlong eval --agent model` on a run's checkpoint reproduces that run's held-out eval: one runner,
one seed rule (furlong.seeding.eval_seed), the same engine, limits and concurrency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FAMILY = "count-in-file"
HELDOUT, CONCURRENCY, SEED, TEMPERATURE = 4, 4, 77, 1.0
AGENT = ["train.agent.max_turns=2", "train.agent.max_new_tokens=24"]
RUN = [f"train.families=[{FAMILY}]", "train.sft.instances_per_family=4", "train.sft.epochs=1",
       "train.sft.batch_size=4", "train.rl.steps=1", "train.rl.tasks_per_step=2", "train.rl.group_size=2",
       f"train.rl.concurrency={CONCURRENCY}", f"train.eval.concurrency={CONCURRENCY}",
       f"train.eval.heldout_per_family={HELDOUT}",
       f"train.eval.seed={SEED}", f"train.eval.temperature={TEMPERATURE}", *AGENT]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong.cli", *args], capture_output=True, text=True, timeout=900)


def _eval(model: Path, out: Path) -> dict:
    res = _cli("eval", "--agent", "model", "--model", str(model), "--tasks", f"tasks/{FAMILY}", "--split", "heldout",
               "--per-family", str(HELDOUT), "--seed", str(SEED), "--temperature", str(TEMPERATURE),
               "--concurrency", str(CONCURRENCY), "--out", str(out), *AGENT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def _fingerprint(rows: list[dict], phase: str | None = None) -> dict[str, tuple]:
    """What sampling decides of each episode: its status, reward, turns and sampled tokens."""
    return {r["task"]: (r["status"], r["reward"], r["turns"], r["tokens_response"], r["response_sha"]) for r in rows
            if phase is None or r["phase"] == phase}


def test_furlong_eval_on_a_checkpoint_gives_the_runs_heldout_pass_at_1(tmp_path: Path):
    run = tmp_path / "run"
    res = _cli("train", f"train.run_dir={run}", *RUN)
    assert res.returncode == 0, res.stderr[-3000:]
    phases = json.loads((run / "state.json").read_text())["phases"]
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    for phase, model in (("eval_before", run / "checkpoints" / "sft"), ("eval_after", run / "checkpoints" / "rl-0" / "hf")):
        out = tmp_path / f"{phase}.jsonl"
        summary = _eval(model, out)
        assert summary["episodes"] == HELDOUT and summary["pass_rate"] == phases[phase]["pass_at_1"], phase
        # not only the mean: every held-out episode is the one training sampled
        trained = _fingerprint(records, phase)
        assert len(trained) == HELDOUT and _fingerprint(list(map(json.loads, out.read_text().splitlines()))) == trained
        assert len({v[4] for v in trained.values()}) == HELDOUT  # each task's episode sampled its own tokens
