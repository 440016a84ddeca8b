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


def _demo_task(tmp_path: Path, name: str, solve: str):
    from tests_support import make_task

    return make_task(tmp_path, name, "Write hi to /app/out.txt",
                     test="grep -q hi /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt",
                     solve=solve)


def test_an_oracle_demonstration_is_the_solutions_episode_in_the_agent_format(tiny_dir, backend, base_image, tmp_path):
    """The solution runs as one bash call of an episode of the one runner; the demonstration holds that
    call and its real observation, laid out as demo_tokens lays out a model's turn."""
    from conftest import run
    from tests_support import agent_params
    from furlong.model.loading import load_tokenizer
    from furlong.sandbox.pool import FreshSandboxes, fixed_image
    from furlong.sandbox.base import ImageRef, LayerRef
    from furlong.train.sft import demo_tokens, oracle_demo, oracle_demos, solution_command

    tokenizer, params = load_tokenizer(tiny_dir), agent_params()
    sandboxes = FreshSandboxes(backend, fixed_image(base_image))
    good = _demo_task(tmp_path, "good", "#!/bin/bash\n# writes the file\nmkdir -p /app\necho hi > /app/out.txt\ncat /app/out.txt")
    demo = run(oracle_demo(good, tokenizer, sandboxes, params))
    command = solution_command(good)
    assert command == "mkdir -p /app\necho hi > /app/out.txt\ncat /app/out.txt"
    assert demo == demo_tokens(tokenizer, good, command, "exit code 0\nhi", params)
    # a solution that does not pass teaches nothing; a sandbox that never starts loses its demo, not the run
    wrong = _demo_task(tmp_path, "wrong", "echo nothing")
    assert run(oracle_demo(wrong, tokenizer, sandboxes, params)) is None
    missing = ImageRef(digest="missing", layers=(LayerRef("missing", "no-such-layer"),))
    dead = FreshSandboxes(backend, fixed_image(missing))
    assert run(oracle_demos([good, wrong], tokenizer, dead, params, 2)) == []
    assert [d.task_id for d in run(oracle_demos([good, wrong], tokenizer, sandboxes, params, 2))] == [good.id]
