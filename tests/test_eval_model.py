"""`furlong eval --agent model`: pass@k (furlong.eval.passk), the engine factory, and a real run of a
trained tiny model's exported checkpoint through the training agent loop in real sandboxes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from furlong.engine.base import EngineUnavailable
from furlong.engine.factory import make_engine
from furlong.eval.harness import EpisodeResult
from furlong.eval.passk import ks_for, pass_at_k
from furlong.eval.run import summarize
from furlong.timing import EpisodeTiming

SMOKE = ["train.families=[count-in-file]", "train.sft.instances_per_family=4", "train.sft.epochs=1",
         "train.sft.batch_size=4", "train.rl.steps=1", "train.rl.tasks_per_step=2", "train.rl.group_size=2",
         "train.rl.concurrency=4", "train.sft.concurrency=4", "train.eval.concurrency=4",
         "train.eval.heldout_per_family=2", "train.agent.max_turns=2",
         "train.agent.max_new_tokens=24"]


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_pass_at_k_matches_the_closed_form_by_hand_and_by_enumeration():
    # n=4 samples, c=1 passed: pass@1 = 1 - 3/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1 - 0/1
    assert [pass_at_k(4, 1, k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    for n in range(1, 7):  # the chance that a k-subset of the n samples holds a pass, counted directly
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    assert ks_for(1) == (1,) and ks_for(6) == (1, 2, 4, 6) and ks_for(8) == (1, 2, 4, 8)


def _result(task: str, sample: int, reward: float | None, family: str | None = "fam") -> EpisodeResult:
    return EpisodeResult(task=task, agent="model", reward=reward, timing=EpisodeTiming(), sample=sample,
                         status="ok" if reward is not None else "infra_error", family=family)


def test_summary_reports_pass_at_k_per_task_and_family_and_skips_short_tasks():
    results = [_result("a", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]  # n=4, c=1
    results += [_result("b", i, r) for i, r in enumerate([0.0, 0.0, 1.0, 1.0])]  # n=4, c=2
    results += [_result("c", i, r, None) for i, r in enumerate([0.0, None, None, None])]  # n=1: only pass@1
    s = summarize(results)
    assert s["samples"] == 4 and s["per_task"]["a"] == {"family": "fam", "n": 4, "c": 1,
                                                         "pass_at_k": {"1": 0.25, "2": 0.5, "4": 1.0}}
    assert s["per_task"]["b"]["pass_at_k"] == {"1": 0.5, "2": pytest.approx(5 / 6), "4": 1.0}
    assert s["per_task"]["c"]["pass_at_k"] == {"1": 0.0, "2": None, "4": None}
    assert s["per_family"]["fam"]["pass_at_k"] == {"1": 0.375, "2": pytest.approx((0.5 + 5 / 6) / 2), "4": 1.0}
    assert s["pass_at_k"]["1"] == pytest.approx((0.25 + 0.5 + 0.0) / 3) and s["pass_at_k"]["4"] == 1.0
    assert s["pass_rate"] == 3 / 9 and s["infra_errors"] == 3  # the existing keys keep their meaning


def test_engine_factory_builds_hf_and_names_what_is_wrong(tiny_dir: Path, tmp_path: Path):
    engine = make_engine("hf", tiny_dir, seed=1)
    assert type(engine).__name__ == "HFEngine" and engine.weight_version == 0
    with pytest.raises(EngineUnavailable, match=f"model {tmp_path / 'nope'}: not a directory"):
        make_engine("hf", tmp_path / "nope")
    with pytest.raises(EngineUnavailable, match="no config.json"):
        make_engine("hf", tmp_path)
    with pytest.raises(EngineUnavailable, match="adapter .*no adapter_config.json"):
        make_engine("hf", tiny_dir, adapter=tiny_dir)
    with pytest.raises(EngineUnavailable, match="engine 'tgi': expected one of hf, vllm, sglang"):
        make_engine("tgi", tiny_dir)
    with pytest.raises(EngineUnavailable, match="dtype 'float64'"):
        make_engine("hf", tiny_dir, dtype="float64")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(EngineUnavailable, match="engine 'vllm': vllm is not installed"):
            make_engine("vllm", tiny_dir)


def test_bad_model_path_is_a_one_line_error(tmp_path: Path):
    res = _cli("eval", "--agent", "model", "--model", str(tmp_path / "missing"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: --model {tmp_path / 'missing'}: not a directory "
                                               "(expected a local Hugging Face checkpoint directory)"]
    res = _cli("eval", "--agent", "model")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "needs --model" in res.stderr


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real short run: SFT on oracle demos, one GRPO step (checkpoint rl-0 with its hf/ export)."""
    run = tmp_path_factory.mktemp("run") / "r"
    res = _cli("train", f"train.run_dir={run}", *SMOKE)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def test_rl_checkpoint_export_is_the_trainers_model(trained_run: Path):
    from transformers import AutoModelForCausalLM

    from furlong.model.loading import load_model

    summary = json.loads((trained_run / "summary.json").read_text())
    hf = trained_run / "checkpoints" / "rl-0" / "hf"
    assert summary["hf_model"] == str(hf) and summary["hf_adapter"] is None
    trainer_model = load_model(trained_run / "checkpoints" / "sft")
    trainer_model.load_state_dict(torch.load(hf.parent / "trainer.pt", map_location="cpu")["model"])
    exported = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 250, 3, 1024]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trainer_model(input_ids=ids).logits)
        # the export is the policy after the step: the SFT model exactly when the step made no update (all
        # of its groups had no reward variance), a different one when it did
        updated = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()
                   if '"phase": "rl"' in line][0]["updated"]
        sft = load_model(trained_run / "checkpoints" / "sft")
        assert torch.equal(exported(input_ids=ids).logits, sft(input_ids=ids).logits) is not updated


def test_eval_model_runs_k_samples_and_reports_monotone_pass_at_k(trained_run: Path, tmp_path: Path):
    out = tmp_path / "eval.jsonl"
    res = _cli("eval", "--agent", "model", "--model", str(trained_run / "checkpoints" / "rl-0" / "hf"),
               "--tasks", "tasks/count-in-file", "--per-family", "2", "--samples", "4", "--concurrency", "4",
               "--out", str(out), "train.agent.max_turns=2", "train.agent.max_new_tokens=24")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.splitlines()[-1])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == summary["episodes"] == 8 and summary["samples"] == 4 and summary["ks"] == [1, 2, 4]
    by_task: dict[str, list[dict]] = {}
    for line in lines:  # the same lines as the scripted agents', plus sample and turns
        assert line["agent"] == "model" and line["family"] == "count-in-file" and "verifier_output" in line
        assert line["status"] == "infra_error" or line["turns"] >= 1
        by_task.setdefault(line["task"], []).append(line)
    assert all(sorted(r["sample"] for r in rows) == [0, 1, 2, 3] for rows in by_task.values())
    for task, rows in by_task.items():
        scored = [r["reward"] for r in rows if r["reward"] is not None]
        n, c = len(scored), sum(r >= 1 for r in scored)
        got = summary["per_task"][task]["pass_at_k"]
        assert got == {str(k): (pass_at_k(n, c, k) if n >= k else None) for k in (1, 2, 4)}
        values = [v for v in got.values() if v is not None]
        assert values == sorted(values)  # monotone in k
    family = summary["per_family"]["count-in-file"]
    assert family["scored"] + family["infra_errors"] == 8 and set(family["pass_at_k"]) == {"1", "2", "4"}
