"""The FSDP2 trainer (furlong.train.fsdp2) at world size 2 on gloo, real rank processes, against LocalTrainer on
the same fixed batch: two minibatches (so two optimizer steps, and the no-grad "old" pass), micro-batches of
2 (so ranks hold different numbers of them and run idle passes).

Tolerance: the ranks sum the same per-token terms in another order (and the anchor splits its demonstrations),
so results agree to float32 rounding: stats to a relative 1e-4, weights after the step to an absolute 1e-5
(lr 1e-3 moves them by ~1e-3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.model.loading import frozen_model, load_model, load_tokenizer
from furlong.model.lora import LoraSpec, wrap_lora
from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer
from furlong.train.protocol import Trainer
from furlong.train.ranks import LocalRanks
from furlong.train.trainer import LocalTrainer
from fsdp2_support import fixed_demos, fixed_episodes
from tests_support import Background, grpo

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WEIGHT_TOL = 1e-5
STAT_TOL = 1e-4
LORA = LoraSpec(rank=4, alpha=8)
# kl-bf16: train.model.frozen_dtype bfloat16, the sharded reference in bf16 on each rank
CASES = {"plain": {}, "kl": {"kl_coef": 0.1}, "kl-bf16": {"kl_coef": 0.1, "frozen_dtype": "bfloat16"},
         "anchor": {"sft_coef": 0.5, "sft_batch": 3}}


def _spec(model_dir: Path, lora: LoraSpec | None = None, frozen_dtype: str = "float32", **rl) -> FSDP2Spec:
    config = grpo(lr=1e-3, micro_batch_size=2, minibatches=2, **rl)
    demos = fixed_demos() if config.sft_coef > 0 else ()
    return FSDP2Spec(model_dir, config, lora=lora, demos=demos, frozen_dtype=frozen_dtype)


def _local(spec: FSDP2Spec) -> LocalTrainer:
    model = load_model(spec.model_dir)
    if spec.lora is not None:
        model = wrap_lora(model, spec.lora, seed=spec.lora_seed)
    ref = frozen_model(spec.model_dir, spec.frozen_dtype) if spec.config.kl_coef > 0 else None
    cfg = spec.config
    teacher = None if spec.teacher is None else spec.teacher.build(spec.model_dir, cfg, torch.device("cpu"), load_model)
    return LocalTrainer(model, cfg, ref_model=ref, demos=spec.demos, teacher=teacher)


def _fsdp2(spec: FSDP2Spec, world_size: int = 2) -> FSDP2Trainer:
    return FSDP2Trainer(LocalRanks(spec, world_size, timeout_s=120, call_timeout_s=300), spec)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert sorted(a) == sorted(b)
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= tol, f"weights differ by {worst}"


def _assert_same_step(local: LocalTrainer, fsdp: FSDP2Trainer) -> None:
    episodes = fixed_episodes()
    before = {k: v.clone() for k, v in local.engine_weights().items()}
    want, got = local.train_step(episodes), fsdp.train_step(episodes)
    assert got.version == fsdp.version == want.version == 1
    for name in ("loss", "grad_norm", "grad_norm_rl", "entropy", "sft_nll", "ref_kl", "ppo_kl", "clip_frac"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=STAT_TOL, abs=1e-7), name
    assert (got.tokens, got.loss_tokens, got.groups_used) == (want.tokens, want.loss_tokens, want.groups_used)
    moved = max(float((local.engine_weights()[k] - before[k]).abs().max()) for k in before)
    assert moved > 50 * WEIGHT_TOL  # the step moved the weights well beyond the tolerance
    _assert_same_weights(dict(fsdp.engine_weights()), local.engine_weights(), WEIGHT_TOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_matches_local_trainer(small_dir: Path, case: str) -> None:
    spec = _spec(small_dir, **CASES[case])
    fsdp = _fsdp2(spec)
    try:
        assert isinstance(fsdp, Trainer)
        _assert_same_step(_local(spec), fsdp)
        if case == "anchor":
            assert fsdp.train_step(fixed_episodes()).sft_nll > 0
    finally:
        fsdp.close()


@pytest.fixture(scope="module")
def lora_pair(small_dir: Path):
    """A LoRA policy, one step taken by the local trainer and by FSDP2 at world size 2."""
    spec = _spec(small_dir, lora=LORA, kl_coef=0.1)
    local, fsdp = _local(spec), _fsdp2(spec)
    try:
        _assert_same_step(local, fsdp)
        yield spec, local, fsdp
    finally:
        fsdp.close()


def test_lora_engine_weights_are_the_adapters(lora_pair) -> None:
    _, local, fsdp = lora_pair
    weights = fsdp.engine_weights()
    assert weights and all("lora_" in k for k in weights)
    assert fsdp.engine_weights() is weights  # gathered once per version


def test_export_hf_equals_the_local_export(lora_pair, small_dir: Path, tmp_path: Path) -> None:
    _, local, fsdp = lora_pair
    tokenizer = load_tokenizer(small_dir)
    ours = fsdp.export_hf(tmp_path / "fsdp2", tokenizer, base_model=small_dir)
    theirs = local.export_hf(tmp_path / "local", tokenizer, base_model=small_dir)
    assert (ours / "adapter" / "adapter_config.json").is_file()
    a = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    b = AutoModelForCausalLM.from_pretrained(theirs).state_dict()
    _assert_same_weights(a, b, WEIGHT_TOL)


def test_save_at_two_ranks_loads_at_one(lora_pair, tmp_path: Path) -> None:
    """The whole training state: after the load, one more step on each gives the same weights."""
    spec, _, fsdp = lora_pair
    fsdp.save(tmp_path / "ckpt")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp directory left
    assert_resumes(fsdp, _fsdp2(spec, world_size=1), tmp_path / "ckpt", fixed_episodes(seed=3))


def assert_resumes(saved: FSDP2Trainer, fresh: FSDP2Trainer, ckpt: Path, episodes: list) -> None:
    """`fresh` loads `saved`'s checkpoint `ckpt`: the same weights, then after one more step on each the same
    weights again (the optimizer state and RNG came back too). Closes `fresh`."""
    try:
        fresh.load(ckpt)
        assert fresh.version == saved.version
        _assert_same_weights(dict(fresh.engine_weights()), dict(saved.engine_weights()), 0.0)
        fresh.train_step(episodes)
        saved.train_step(episodes)
        _assert_same_weights(dict(fresh.engine_weights()), dict(saved.engine_weights()), WEIGHT_TOL)
    finally:
        fresh.close()


def test_load_refuses_a_local_checkpoint(lora_pair, tmp_path: Path) -> None:
    _, local, fsdp = lora_pair
    local.save(tmp_path / "local")
    with pytest.raises(ValueError, match="not an fsdp2 checkpoint"):
        fsdp.load(tmp_path / "local")


def _rank_pids(driver: int) -> list[int]:
    """The driver's spawned rank processes, oldest (rank 0) first."""
    children = Path(f"/proc/{driver}/task/{driver}/children").read_text().split()
    ranks = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(ranks, key=lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))


@pytest.mark.slow  # three `furlong train` runs (~60-90 s on a loaded 2-core box)
def test_train_run_survives_a_killed_rank_with_resume(tmp_path: Path) -> None:
    """`furlong train train.trainer=fsdp2`, self-distilling beside GRPO (the teacher: the sharded policy under
    another system prompt): SIGKILL of a rank mid-RL ends the run with RankFailed (bounded); `--resume` finishes
    it from the last checkpoint with the samples of a run never killed, every step logged, every episode
    recorded once and every RL episode scored by the teacher."""
    from test_train_run import SMALL as RUN, _rl_rows, _train

    SMALL = [*RUN, "train.distill.mode=grpo+opd", "train.distill.teacher.system_prompt=Answer in few words."]
    whole, run = tmp_path / "whole", tmp_path / "run"
    # the run never killed goes beside the one that is (CI's second core): they share no state
    reference = Background(tmp_path / "whole.log", "train", f"train.run_dir={whole}", *SMALL, "train.trainer=fsdp2")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "train", f"train.run_dir={run}", *SMALL,
                                 "train.trainer=fsdp2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not any(r["step"] >= 1 for r in _rl_rows(run)) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]  # type: ignore[union-attr]
            time.sleep(0.2)
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "RankFailed: rank 1 died: killed by SIGKILL" in err, err[-3000:]
        res = reference.result(timeout_s=900)
    finally:
        reference.stop()  # a failure above: no waiting for it
    assert res.returncode == 0, res.stderr[-3000:]
    done = len(_rl_rows(run))
    res = _train("--resume", str(run), wait=True)  # the run's own config: distillation too
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and done < 4
    assert [r["samples_sha"] for r in rows] == [r["samples_sha"] for r in _rl_rows(whole)]
    assert (run / "checkpoints" / "rl-3" / "shards").is_dir() and (run / "checkpoints" / "rl-3" / "hf").is_dir()
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    keys = [(r["phase"], r["step"], r["group"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == 4 * 2 * 2 + 2 * 4
    trained = [r for r in records if r["phase"] == "rl" and r["outcome"] == "trained"]
    assert trained and all(r["distill"]["status"] == "scored" for r in trained), trained[:1]
    assert all(r["distill"]["tokens"] == r["tokens_response"] for r in trained)
    assert all(r["distill_scored"] == 4 and r["distill_failed"] == 0 and r["teacher_seconds"] > 0 for r in rows)
