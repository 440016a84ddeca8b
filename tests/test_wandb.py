"""W&B beside metrics.jsonl and TensorBoard (train.log.wandb), offline: the run is read back from its `.wandb`
file with wandb's own reader (`wandb leet inspect --json`), no network. Also the worked example of a Python
environment (examples/guess_number.yaml) trained for real through `furlong train`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from furlong.build.training import attach_loggers
from furlong.config import TrainConfig
from furlong.metrics.run import RunDir

ROOT = Path(__file__).resolve().parent.parent
# no network: wandb's reader would otherwise send its own telemetry (the runs here are offline anyway)
OFFLINE = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}


def wandb_records(run_path: Path) -> list[dict]:
    """Every record of the run's offline `.wandb` file, as wandb's reader prints them."""
    [log] = run_path.glob("wandb/offline-run-*/run-*.wandb")
    res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, timeout=120, env=OFFLINE)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def assert_same_as_metrics_jsonl(run_path: Path, records: list[dict]) -> None:
    """Every numeric value of every metrics.jsonl row is in W&B's history as `<phase>/<key>`, at the row's step."""
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    rows = RunDir.open(run_path).metrics()
    assert rows and len(history) == len(rows)
    for row in rows:
        phase = row["phase"]
        [item] = [h for h in history if h.get(f"{phase}/step") == row["step"]]
        for key, value in row.items():
            if key in ("phase", "step", "time") or not isinstance(value, (int, float)):
                continue
            logged = item[f"{phase}/{key}"]
            assert logged == value or (math.isnan(value) and str(logged).lower() == "nan"), (phase, key)


def test_wandb_logs_the_rows_of_metrics_jsonl_each_phase_on_its_own_step_axis(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    t = TrainConfig(log={"wandb": {"enabled": True, "mode": "offline", "project": "furlong-test"}})
    run = RunDir.create(tmp_path / "run", {"train": {"seed": 3}})
    attach_loggers(t, run)
    for step in range(3):
        run.log("sft", step, {"loss": 1.0 / (step + 1)})
    for step in range(2):  # a phase starting again at step 0 (W&B's own step only grows)
        run.log("rl", step, {"reward_mean": 0.25 * step, "grad_norm": float("nan"), "samples_sha": "abc"})
    run.close()
    records = wandb_records(run.path)
    assert_same_as_metrics_jsonl(run.path, records)
    [header] = [r["run"] for r in records if r["type"] == "run"]
    assert header["project"] == "furlong-test" and header["config"]["update"]["train"] == {"seed": 3}
    assert header["run_id"] == (run.path / "wandb-run-id").read_text()


def test_wandb_is_not_imported_unless_enabled(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    run = RunDir.create(tmp_path / "run", {})
    attach_loggers(TrainConfig(), run)
    run.log("rl", 0, {"reward_mean": 1.0})
    run.close()
    assert run.metrics("rl")[0]["reward_mean"] == 1.0 and not (run.path / "wandb").exists()


def test_the_example_environment_trains_and_its_metrics_reach_wandb(tmp_path):
    run = tmp_path / "guess"
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--config", "examples/guess_number.yaml",
                          f"train.run_dir={run}", "train.log.wandb.enabled=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=OFFLINE)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["families"] == ["GuessNumber"] and summary["rl_steps"] == 2 and summary["eval_episodes"] == 2
    assert summary["eval_infra_errors"] == 0 and summary["demonstrated_families"] == ["GuessNumber"]
    # SFT on the environment's demonstrations gave RL a model that acts: some group's rewards differed
    assert summary["rl_steps_updated"] >= 1
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["phase"] == "rl"]) == 2 * 2 * 4
    # every episode was scored, its reward's parts recorded: the steps' own and the reward functions'
    assert all(r["reward"] is not None and set(r["rewards"]) == {"steps", "few_guesses", "concise"} for r in records)
    assert [r["step"] for r in RunDir.open(run).metrics("rl")] == [0, 1]
    assert_same_as_metrics_jsonl(run, wandb_records(run))
