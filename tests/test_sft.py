"""furlong.train.sft.sft_train on the tiny model: zero epochs leave the model as it is (bench/rl_vs_sft.py's
arm C starts RL from an already fine-tuned model that way), and no demonstrations is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furlong.model.loading import load_model
from furlong.train.sft import Demo, load_demos, save_demos, sft_train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _demo() -> Demo:
    return Demo(task_id="t", tokens=tuple(range(5, 25)), loss_mask=(0,) * 10 + (1,) * 10)


def test_zero_epochs_train_nothing_and_need_no_demonstrations(tiny_dir: Path):
    model = load_model(tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sft_train(model, [], epochs=0, lr=1e-3, batch_size=4, seed=0, pad_id=0) == []
    assert sft_train(model, [_demo()], epochs=0, lr=1e-3, batch_size=4, seed=0, pad_id=0) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_one_epoch_changes_the_model_and_no_demonstrations_is_an_error(tiny_dir: Path):
    model = load_model(tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = sft_train(model, [_demo(), _demo()], epochs=1, lr=1e-3, batch_size=1, seed=0, pad_id=0)
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="no demonstrations"):
        sft_train(model, [], epochs=1, lr=1e-3, batch_size=4, seed=0, pad_id=0)


def test_demonstrations_round_trip_through_their_file_and_a_bad_line_names_itself(tmp_path: Path):
    demos = [_demo(), Demo(task_id="u", tokens=(1, 2, 3), loss_mask=(0, 1, 1))]
    save_demos(tmp_path / "demos.jsonl", demos)
    assert load_demos(tmp_path / "demos.jsonl") == demos
    (tmp_path / "bad.jsonl").write_text('{"task_id": "t", "tokens": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a demonstration"):
        load_demos(tmp_path / "bad.jsonl")
