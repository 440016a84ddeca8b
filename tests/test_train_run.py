"""`furlong train` end to end on a small config: the run directory, and resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from furlong.config import REPO_ROOT
from furlong.metrics.run import RunDir
from tests_support import Background

SMALL = [
    "train.families=[count-in-file, number-stats]", "train.sft.families=[count-in-file]",  # number-stats: reward-only
    "train.sft.instances_per_family=4", "train.sft.epochs=1", "train.sft.batch_size=4",
    "train.rl.steps=4", "train.rl.tasks_per_step=2", "train.rl.group_size=2", "train.rl.concurrency=4",
    "train.rl.checkpoint_every=1", "train.eval.heldout_per_family=2", "train.sft.concurrency=4",
    "train.eval.concurrency=4",
    "train.agent.max_turns=1", "train.agent.max_new_tokens=24",
]


def _train(*args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "furlong.cli", "train", *args]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _train_past_step_0(run: Path, transport: str) -> subprocess.Popen:
    """A small `furlong train` over 2 engine servers (train.sync.transport=`transport`) in which every step
    trains, returned once step 0 is logged: its weights are pushed and step 1's episodes are running."""
    proc = _train(f"train.run_dir={run}", *SMALL, "train.agent.max_new_tokens=96", "train.agent.max_turns=2",
                  f"train.sync.transport={transport}", "train.sync.engine=server", "train.sync.servers=2",
                  "train.rl.filter_zero_variance=false", wait=False)  # every step trains: the version moves
    deadline = time.monotonic() + 600
    while not _rl_rows(run) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before step 0 was logged"
        time.sleep(0.05)
    assert _rl_rows(run), "step 0 was not logged within 600 s"
    return proc


def _rl_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["phase"] == "rl"]


def _kill_after_step_1(killed: Path) -> None:
    """A SMALL run SIGKILLed (with all its processes) once RL step 1 is logged: it ends with no summary."""
    proc = _train(f"train.run_dir={killed}", *SMALL, wait=False)
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] >= 1 for r in _rl_rows(killed)) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (killed / "summary.json").exists()


def _move_checkout(run: Path, old: Path) -> None:
    """Rewrite a run directory as if it had been made from a furlong checkout at `old` (gone now)."""
    state = json.loads((run / "state.json").read_text())
    assert state["checkout"] == str(REPO_ROOT)
    (run / "state.json").write_text(json.dumps({**state, "checkout": str(old)}))
    text = (run / "config.yaml").read_text()
    assert f"{REPO_ROOT}/tasks" in text
    (run / "config.yaml").write_text(text.replace(f"{REPO_ROOT}/", f"{old}/"))


def test_a_resumed_run_finds_paths_of_its_moved_checkout_and_keeps_the_users_own(tmp_path: Path):
    old, new = tmp_path / "old", tmp_path / "new"
    (new / "tasks").mkdir(parents=True)
    (old / "recipes").mkdir(parents=True)  # still there: kept as it is
    mine = tmp_path / "my-tasks"  # the user's own files, gone: kept, and the run's own error names them
    config = {"train": {"tasks": f"{old}/tasks", "recipe": f"{old}/recipes", "data": f"{old}/data", "seed": 1},
              "sandbox": {"tasks": str(mine)}}
    run = RunDir.create(tmp_path / "run", config, checkout=old)
    moved_config, moved = run.relocated_config(new)
    assert moved == [f"train.tasks: {old}/tasks -> {new}/tasks"]
    assert moved_config["train"] == {**config["train"], "tasks": f"{new}/tasks"}  # data: no counterpart, kept
    assert moved_config["sandbox"] == config["sandbox"]
    assert run.relocated_config(old) == (config, [])  # resumed where it was made: nothing moves
    assert RunDir.create(tmp_path / "run2", config).relocated_config(new) == (config, [])  # no checkout recorded


def test_train_writes_a_complete_run_directory_and_resumes_after_kill(tmp_path: Path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # the run never killed goes beside the one that is (CI's second core): they share no state
    reference = Background(tmp_path / "whole.log", "train", f"train.run_dir={whole}", *SMALL)
    try:
        _kill_after_step_1(killed)
        res = reference.result(timeout_s=900)
    finally:
        reference.stop()  # a failure above: no waiting for it
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary == json.loads(res.stdout.splitlines()[-1])
    assert summary["eval_episodes"] == 4 and set(summary["phase_seconds"]) == {"sft", "eval_before", "rl", "eval_after"}
    assert 0.0 <= summary["heldout_pass_at_1_after_rl"] <= 1.0
    # SFT saw only the demonstrated family's demonstrations; the gains are reported per group with intervals
    assert json.loads((whole / "state.json").read_text())["phases"]["sft"]["demos"] == 4
    assert (summary["demonstrated_families"], summary["reward_only_families"]) == (["count-in-file"], ["number-stats"])
    gain = summary["heldout_gain"]
    assert gain["reward_only"] == gain["per_family"]["number-stats"] and gain["reward_only"]["instances"] == 2
    lo, hi = gain["demonstrated"]["gain_ci90"]
    assert lo <= gain["demonstrated"]["gain_points"] <= hi and summary["seed"] == 0
    rows = _rl_rows(whole)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert summary["rl_steps_updated"] == sum(bool(r["updated"]) for r in rows)
    for key in ("reward_mean", "pass_rate", "logprob_diff_mean", "rollout_train_kl", "ppo_kl", "clip_frac",
                "entropy", "grad_norm", "response_len_mean", "tokens_per_s", "time_model_wait", "sample_lag_mean"):
        assert key in rows[0], key
    assert any((whole / "tb").iterdir()) and (whole / "config.yaml").exists()
    assert (whole / "checkpoints" / "sft" / "config.json").exists() and (whole / "checkpoints" / "rl-3").exists()
    # resuming a finished run needs no demonstrations, as a run from before demos.jsonl has none
    (whole / "demos.jsonl").unlink()
    res = _train("--resume", str(whole), "--require-update")
    assert res.returncode == (0 if summary["rl_steps_updated"] else 1), res.stderr[-3000:]
    assert ("no RL step updated the policy" in res.stderr) == (not summary["rl_steps_updated"]), res.stderr[-2000:]
    assert json.loads(res.stdout.splitlines()[-1])["heldout_pass_at_1_after_rl"] == summary["heldout_pass_at_1_after_rl"]

    _move_checkout(killed, Path("/gone/furlong"))  # made from a checkout since moved: resumed from this one
    res = _train("--resume", str(killed))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"train.tasks: /gone/furlong/tasks -> {REPO_ROOT / 'tasks'}" in " ".join(res.stderr.split()), res.stderr[-2000:]
    resumed = _rl_rows(killed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # same step count, nothing logged twice
    # the same samples, in the same steps, as the run that was never killed
    assert [r["samples_sha"] for r in resumed] == [r["samples_sha"] for r in rows]
    # every episode recorded once: the records of the steps redone after the kill were dropped first
    records = [json.loads(line) for line in (killed / "episodes.jsonl").read_text().splitlines()]
    keys = [(r["phase"], r["step"], r["group"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == 4 * 2 * 2 + 2 * 4


def test_train_with_lora_updates_only_adapters(tmp_path: Path):
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "lora"
    # with a KL penalty too: its frozen reference is the SFT model, adapters or not
    # RL on the reward-only family alone (train.rl.families); the evals still cover both families
    res = _train(f"train.run_dir={run}", *SMALL, "train.rl.steps=2", "train.lora.enabled=true", "train.lora.rank=4",
                 "train.rl.kl_coef=0.1", "train.rl.lr_decay=cosine", "train.rl.families=[number-stats]")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1]
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    assert {r["family"] for r in records if r["phase"] == "rl"} == {"number-stats"}
    assert len([r for r in records if r["phase"] == "rl"]) == 2 * 2 * 2
    assert {r["family"] for r in records if r["phase"] == "eval_after"} == {"count-in-file", "number-stats"}
    assert rows[0]["ref_kl"] < 1e-6  # fresh adapters are the identity: the policy starts at its reference
    state = torch.load(run / "checkpoints" / "rl-1" / "trainer.pt", weights_only=True)["model"]
    sft = load_file(run / "checkpoints" / "sft" / "model.safetensors")
    adapters = [k for k in state if "lora_" in k]
    assert adapters, "no adapter tensors in the RL checkpoint"
    for name, tensor in sft.items():  # the frozen base is bit-for-bit the SFT model
        key = next(k for k in state if k.endswith(name.replace(".weight", ".base_layer.weight")) or k.endswith(name))
        assert torch.equal(state[key], tensor), name
