"""The Trainer seam: the RL loop drives any implementation of furlong.train.protocol.Trainer, and reaches
the policy only through it. A second implementation here holds its model where the loop cannot see it."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from conftest import run
from furlong.build.training import grpo_config
from furlong.config import load_config
from furlong.engine.hf import HFEngine
from furlong.metrics.run import RunDir
from furlong.model.loading import load_model, load_tokenizer
from furlong.rollout.groups import Rollouts
from furlong.run.driver import rl_steps
from furlong.sandbox.pool import WarmPools, fixed_image
from furlong.train.protocol import Trainer
from furlong.train.trainer import LocalTrainer
from furlong.train.weights import DirectLink
from tests_support import agent_params, make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HALF_PASS = "mkdir -p /logs/verifier; echo $((RANDOM % 2)) > /logs/verifier/reward.txt"


class SealedTrainer:
    """A Trainer that is not LocalTrainer: it keeps its policy in a closure, so a loop that reached for
    `trainer.model` (or anything beyond the protocol) fails, and it records every call it gets."""

    def __init__(self, inner: LocalTrainer) -> None:
        self.calls: list[str] = []
        self.version = inner.version

        def call(name: str, *args):
            self.calls.append(name)
            out = getattr(inner, name)(*args)
            self.version = inner.version
            return out

        self._call = call
        self._device = inner.device

    @property
    def device(self) -> torch.device:
        return self._device

    def train_step(self, episodes):
        return self._call("train_step", episodes)

    def score_teacher(self, episodes):
        return self._call("score_teacher", episodes)

    def engine_weights(self):
        return self._call("engine_weights")

    def close(self) -> None:
        self._call("close")

    def save(self, path: Path) -> None:
        self._call("save", path)

    def load(self, path: Path) -> None:
        self._call("load", path)

    def export_hf(self, out: Path, tokenizer, base_model: Path | None = None) -> Path:
        return self._call("export_hf", out, tokenizer, base_model)


def test_local_trainer_implements_the_protocol(tiny_dir):
    trainer = LocalTrainer(load_model(tiny_dir), grpo_config(load_config(None, ["train.rl.kl_coef=0", "train.rl.sft_coef=0"]).train))
    assert isinstance(trainer, Trainer) and isinstance(SealedTrainer(trainer), Trainer)
    assert trainer.device == torch.device("cpu")
    assert set(trainer.engine_weights()) == set(load_model(tiny_dir).state_dict())


def test_the_rl_loop_runs_a_second_trainer_through_the_protocol_alone(tiny_dir, backend, base_image, tmp_path):
    tasks = [make_task(tmp_path / "tasks", f"t{i}", "Create /tmp/done", HALF_PASS) for i in range(2)]
    cfg = load_config(None, ["train.rl.steps=2", "train.rl.tasks_per_step=2", "train.rl.group_size=2",
                             "train.rl.concurrency=4", "train.rl.checkpoint_every=1", "train.rl.lr=0.01",
                             "train.rl.kl_coef=0", "train.rl.sft_coef=0", "train.rl.families=null"])
    run_dir = RunDir.create(tmp_path / "run", {})
    tokenizer = load_tokenizer(tiny_dir)
    trainer = SealedTrainer(LocalTrainer(load_model(tiny_dir), grpo_config(cfg.train)))
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=())

    async def go():
        link = DirectLink(engine)
        async with WarmPools(backend, fixed_image(base_image)) as pools:
            rollouts = Rollouts(engine, tokenizer, pools, agent_params(max_turns=2, max_new_tokens=8), 4)
            await link.push(trainer.engine_weights(), trainer.version)
            pieces = SimpleNamespace(train_tasks=tasks, tokenizer=tokenizer)
            await rl_steps(cfg, trainer, rollouts, link, pieces, run_dir, Console(file=open(os.devnull, "w")), 0)
        await link.close()

    run(go())
    rows = run_dir.metrics("rl")
    assert [r["step"] for r in rows] == [0, 1] and all(r["episodes"] == 4 for r in rows)
    assert trainer.calls.count("train_step") == 2 and trainer.calls.count("save") == 2
    assert trainer.calls.count("engine_weights") == 3  # the first push, then one per step
    assert engine.weight_version == trainer.version  # the engine holds the last version trained
    exported = load_model(run_dir.checkpoint_dir("rl-1") / "hf")  # checkpoints export through the seam too
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, engine.model.state_dict()[name]), name


def test_the_driver_never_reaches_into_a_trainer_beyond_the_protocol():
    """Every attribute the run package reads off a variable named `trainer` is a protocol member."""
    allowed = {"version", "device", "train_step", "score_teacher", "engine_weights", "save", "load", "export_hf", "close"}
    used = set()
    for path in (Path(__file__).parent.parent / "furlong" / "run").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
                used.add(node.attr)
    assert used and used <= allowed, sorted(used - allowed)
