"""Reward-only families (train.sft.families) and the held-out gains summary.json reports for them."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from furlong.config import ConfigError, load_config
from furlong.metrics.gains import heldout_gains
from furlong.tasks.family import load_family

TASKS = Path(__file__).resolve().parent.parent / "tasks"
REWARD_ONLY = ("number-words", "text-words")
TWIN = {"number-words": "number-stats", "text-words": "transform-text"}  # same commands, other words


def test_sft_families_split_demonstrated_from_reward_only():
    cfg = load_config(None, ["train.families=[number-stats, number-words]", "train.sft.families=[number-stats]"])
    assert cfg.train.demonstrated() == ("number-stats",) and cfg.train.reward_only() == ("number-words",)
    every = load_config(None, ["train.families=[number-stats, number-words]"])
    assert every.train.demonstrated() == ("number-stats", "number-words") and every.train.reward_only() == ()
    default = load_config(None, [])  # the embedded default: two demonstrated families, one reward-only
    assert default.train.demonstrated() == ("number-stats", "transform-text")
    assert default.train.reward_only() == ("number-words",)
    assert default.train.rl.families == ("number-words",)  # the default's RL: its reward-only family
    # a recipe's own families (or its own demonstrated ones) make RL draw from all, unless it names some
    assert cfg.train.rl.families is None and every.train.rl.families is None
    assert load_config(None, ["train.sft.families=[number-stats]"]).train.rl.families is None
    only = load_config(None, ["train.rl.families=[number-words]"])
    assert only.train.rl.families == ("number-words",)


def test_rl_families_outside_train_families_are_refused():
    with pytest.raises(ConfigError, match=r"train.rl.families: \['text-words'\] not in train.families"):
        load_config(None, ["train.rl.families=[text-words]"])


def test_sft_families_outside_train_families_are_refused():
    with pytest.raises(ConfigError, match=r"train.sft.families: \['text-words'\] not in train.families"):
        load_config(None, ["train.families=[number-stats]", "train.sft.families=[text-words]"])


def _generate(family: str):
    spec = importlib.util.spec_from_file_location(f"gen_{family.replace('-', '_')}", TASKS / family / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", REWARD_ONLY)
def test_reward_only_families_use_words_their_twin_never_shows(family: str):
    """The commands are the demonstrated twin's, the instructions are not: which words mean which command
    can only be learned from reward."""
    mine, twin = _generate(family).OPS, _generate(TWIN[family]).OPS
    assert {op: cmd for op, (_, cmd) in mine.items()} == {op: cmd for op, (_, cmd) in twin.items()}
    twin_templates = {t for templates, _ in twin.values() for t in templates}
    assert not twin_templates & {t for templates, _ in mine.values() for t in templates}


@pytest.mark.parametrize("family", REWARD_ONLY)
def test_a_heldout_instance_is_not_solved_by_a_memorised_train_answer(family: str, tmp_path: Path):
    """The most common train answer of each instruction passes almost no held-out instance."""
    fam = load_family(TASKS / family)
    def answers(split: str, n: int) -> list[tuple[str, str]]:
        return [(t.instruction, (t.path / "tests" / "expected.txt").read_text()) for t in fam.instances(split, n)]
    train, heldout = answers("train", 128), answers("heldout", 128)
    commonest = {ins: Counter(a for i, a in train if i == ins).most_common(1)[0][0] for ins, _ in train}
    copied = sum(commonest.get(ins) == a for ins, a in heldout)
    assert copied / len(heldout) < 0.05, copied


def _record(phase: str, task: str, family: str, reward: float | None) -> dict:
    return {"phase": phase, "task": task, "family": family, "reward": reward,
            "status": "ok" if reward is not None else "infra_error"}


def test_heldout_gains_pair_the_same_instances(tmp_path: Path):
    rows = []
    for i in range(40):  # family a: 10/40 -> 30/40; family b: unchanged 20/40
        rows += [_record("eval_before", f"a{i}", "a", float(i < 10)), _record("eval_after", f"a{i}", "a", float(i < 30)),
                 _record("eval_before", f"b{i}", "b", float(i % 2)), _record("eval_after", f"b{i}", "b", float(i % 2))]
    rows += [_record("eval_before", "a40", "a", None), _record("eval_after", "a40", "a", 1.0)]  # unscored: unpaired
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = heldout_gains(tmp_path, {"reward_only": ("a",), "demonstrated": ("b",), "none": ()})
    a, b = g["per_family"]["a"], g["per_family"]["b"]
    assert a["instances"] == 40 and (a["before"], a["after"], a["gain_points"]) == (0.25, 0.75, 50.0)
    assert a["gain_ci90"][0] < 50.0 < a["gain_ci90"][1] and a["gain_ci90"][0] > 30
    assert b["gain_points"] == 0.0 and b["gain_ci90"] == [0.0, 0.0]  # identical outcomes: no spread at all
    assert g["reward_only"] == a and g["demonstrated"] == b and g["none"] is None
