"""Prompt datasets (docs/prompts.md): JSONL, Parquet and Hugging Face `datasets` files written here with the
real libraries, rows checked with errors that name the file, row and field, single-turn episodes scored by
a Python reward function through the one episode runner, and `furlong train` / `furlong eval` on the
bundled example."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import run
from tests_support import agent_params

from furlong.agent.episode import run_episode
from furlong.agent.runner import run_outcome
from furlong.build.environment import load_callable, prompt_source, run_env
from furlong.cli import main
from furlong.config import ConfigError, load_config
from furlong.engine.base import Generation, SamplingParams
from furlong.envs.prompt_data import DatasetError, read_dataset
from furlong.envs.prompts import PromptEnv
from furlong.eval.agents import AnswerAgent, NoopAgent
from furlong.model.chat import Message, assistant_ids
from furlong.model.loading import load_tokenizer
from furlong.model.tiny import init_tiny

ROOT = Path(__file__).resolve().parent.parent
ROWS = [{"prompt": f"What is {a} + 1?", "a": a, "answer": str(a + 1), "split": "test" if a >= 4 else "train",
         "system": "Reply with a number." if a == 0 else None} for a in range(6)]


def sums(completion: str, row: dict) -> float:
    return float(completion.strip() == str(row["a"] + 1))


def write(tmp_path: Path, fmt: str, rows: list[dict] = ROWS) -> Path:
    """`rows` as a dataset of format `fmt`, written by the library that format belongs to."""
    if fmt == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import datasets

        path = tmp_path / "rows"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def source(path: Path, **prompts):
    cfg = load_config(None, [f"train.env.prompts.path={json.dumps(str(path))}", "train.env.prompts.reward=m:f",
                             *(f"train.env.prompts.{k}={json.dumps(v)}" for k, v in prompts.items())])
    return prompt_source(cfg.train.env, {})


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_each_format_loads_the_same_rows_and_splits_them_by_a_column(tmp_path, fmt):
    src = source(write(tmp_path, fmt), split_field="split", answer_field="answer")
    train, held = src.instances("train"), src.instances("heldout")
    assert [r.instruction for r in held] == ["What is 4 + 1?", "What is 5 + 1?"]
    assert [r.id for r in train] == [f"rows/train-{k}" for k in range(4)] and train[0].family == "rows"
    assert train[0].system_prompt == "Reply with a number." and train[1].system_prompt is None
    assert train[2].answer == "3" and train[2].values["a"] == 2  # every field reaches the reward function
    assert train[3].where == f"{write(tmp_path, fmt)} {'line' if fmt == 'jsonl' else 'row'} 4"


def test_splits_from_a_fraction_a_dataset_dict_a_folder_or_two_files(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # not the user's cache

    drawn = source(write(tmp_path, "jsonl"), heldout_fraction=0.5)
    assert len(drawn.instances("train")) == len(drawn.instances("heldout")) == 3
    assert drawn.instances("heldout") == source(write(tmp_path, "jsonl"), heldout_fraction=0.5).instances("heldout")
    both = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                                 "test": datasets.Dataset.from_list(ROWS[4:])})
    both.save_to_disk(str(tmp_path / "dict"))
    assert [r.values["a"] for r in source(tmp_path / "dict").instances("heldout")] == [4, 5]
    (tmp_path / "hub").mkdir()  # a dataset as the Hub serves it: data files whose names give the splits
    for name, part in (("train", ROWS[:4]), ("test", ROWS[4:])):
        (tmp_path / "hub" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    held = source(tmp_path / "hub").instances("heldout")
    assert [r.values["a"] for r in held] == [4, 5] and held[0].where == f"{tmp_path / 'hub'} split 'test' row 1"
    (tmp_path / "held.parquet").write_bytes(write(tmp_path, "parquet", ROWS[4:]).read_bytes())
    cfg = load_config(None, [f"train.env.prompts.train_path={tmp_path / 'rows.jsonl'}", "train.env.prompts.reward=m:f",
                             f"train.env.prompts.heldout_path={tmp_path / 'held.parquet'}"])
    files = prompt_source(cfg.train.env, {"heldout": 1})
    assert len(files.instances("train")) == 6 and [r.values["a"] for r in files.instances("heldout")] == [4]
    with pytest.raises(DatasetError, match=r"without the splits \['heldout'\] \(it has \['test', 'train'\]\)"):
        source(tmp_path / "dict", splits={"train": "train", "heldout": "heldout"})
    with pytest.raises(DatasetError, match="say which rows are held out"):
        source(write(tmp_path, "jsonl"))


@pytest.mark.parametrize("fmt, row, says", [
    ("jsonl", {"question": "hi"}, "line 2: field 'prompt' is missing (expected the prompt, a string)"),
    ("parquet", {"prompt": None}, "row 2: field 'prompt' is missing"),
    ("jsonl", {"prompt": 7}, "line 2: field 'prompt' is int 7, expected the prompt, a string"),
    ("hf", {"prompt": " "}, "row 2: field 'prompt' is empty"),
    ("jsonl", {"prompt": "ok", "answer": ["3"]}, "line 2: field 'answer' is list ['3'], expected the reference answer"),
    ("jsonl", {"prompt": "ok", "system": 3}, "line 2: field 'system' is int 3, expected the system message"),
])
def test_a_bad_row_names_the_file_the_row_and_the_field(tmp_path, fmt, row, says):
    rows = [{"prompt": "fine", "answer": "1", "system": "s"}, {"answer": "1", **row}]
    path = write(tmp_path, fmt, rows)
    with pytest.raises(DatasetError) as err:
        source(path, heldout_fraction=0.5, answer_field="answer")
    assert str(err.value).startswith(str(path)) and says in str(err.value)


def test_a_file_that_is_not_a_dataset_is_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: expected a JSON object \(one row per line\), got list"):
        read_dataset(tmp_path / "bad.jsonl")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="bad.parquet: not a readable Parquet file"):
        read_dataset(tmp_path / "bad.parquet")
    (tmp_path / "rows.csv").write_text("prompt\nhi\n")
    with pytest.raises(DatasetError, match="cannot tell the format from the suffix '.csv'; set format"):
        read_dataset(tmp_path / "rows.csv")
    with pytest.raises(DatasetError, match="missing.jsonl: no such file or directory"):
        read_dataset(tmp_path / "missing.jsonl")


def test_the_config_checks_the_dataset_and_names_the_reward_function(tmp_path):
    reward_file = tmp_path / "score.py"
    reward_file.write_text("def reward(completion, row):\n    return 1.0\n\n"
                           "def other(completion, row):\n    return 0.0\n")
    assert load_callable(str(reward_file), "k")("x", {}) == 1.0
    assert load_callable(f"{reward_file}:other", "k")("x", {}) == 0.0
    assert load_callable("test_prompts:sums", "k") is sums
    for spec, says in [(f"{reward_file}:nope", "defines no 'nope'"), (str(tmp_path / "no.py"), "no such file"),
                       ("test_prompts:ROWS", "is list, not a function"), ("sums", 'expected "module:function"')]:
        with pytest.raises(ConfigError, match=says):
            load_callable(spec, "train.env.prompts.reward")
    base = [f"train.env.prompts.path={write(tmp_path, 'jsonl')}", "train.env.prompts.heldout_fraction=0.5"]
    cfg = load_config(None, [*base, "train.env.prompts.reward=test_prompts:sums"]).train
    assert (cfg.families, cfg.sft.epochs, cfg.rl.sft_coef) == (("rows",), 0, 0.0)  # no answers: no SFT
    assert run_env(cfg.env, backend=None, images=None).prompts.reward is sums  # type: ignore[union-attr, arg-type]
    for extra, says in [([], "reward: the reward function is needed"),
                        (["train.env.prompts.reward=m:f", "train.env.prompts.train_path=x.jsonl"], "not both"),
                        (["train.env.prompts.reward=m:f", "train.env.python=examples.guess_number:GuessNumber"],
                         "python and prompts: one environment at a time"),
                        (["train.env.prompts.reward=m:f", "train.env.tools=[examples.tools:CALCULATOR]"],
                         "a prompt dataset has no tools"),
                        (["train.env.prompts.reward=m:f", "train.sft.epochs=2"],
                         "train.sft.epochs: the prompt dataset has no answers to demonstrate")]:
        with pytest.raises(ConfigError, match=says):
            load_config(None, [*base, *extra])


def raises(completion: str, row: dict) -> float:
    return {"7": 1.0}[completion]


RELEASE = threading.Event()


def hangs(completion: str, row: dict) -> float:
    RELEASE.wait()  # never set while the episode runs: only the timeout ends the call
    return 1.0


@pytest.mark.parametrize("reward, status, says", [
    (sums, "ok", None),
    (raises, "infra_error", "KeyError: 'oops'"),
    (hangs, "infra_error", "the reward function timed out after 0.3s"),
    (lambda completion, row: "1", "infra_error", "the reward function gave '1', not a finite number"),
    (lambda completion, row: float("nan"), "infra_error", "gave nan, not a finite number"),
])
def test_a_reward_function_that_fails_is_an_unscored_episode_with_its_traceback(tmp_path, reward, status, says):
    row = source(write(tmp_path, "jsonl"), split_field="split", answer_field="answer").instances("train")[1]
    oops = row.__class__(**{**row.__dict__, "answer": "oops"}) if reward is raises else row
    RELEASE.clear()
    outcome = asyncio.run(run_outcome(oops, AnswerAgent(), PromptEnv(reward, timeout_s=0.3)))
    RELEASE.set()  # asyncio.run returned while the call still hung: its thread held nothing up
    assert outcome.status == status, outcome.error
    assert outcome.reward == (1.0 if status == "ok" else None)
    if says:
        assert says in outcome.error and row.where in outcome.error
    if reward is raises:  # the traceback, down to the line that raised
        assert "Traceback" in outcome.error and 'return {"7": 1.0}[completion]' in outcome.error
    # an agent that never answers is scored on the empty completion
    assert run(run_outcome(row, NoopAgent(), PromptEnv(sums))).reward == 0.0


class Says:
    """Test double for the policy: writes `text` (a tool call's syntax included), cut off after `cut` ids."""

    def __init__(self, tokenizer, text: str, cut: int | None = None):
        self.ids = assistant_ids(tokenizer, Message("assistant", text))
        self.cut, self.prompts = cut, []

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        self.prompts.append(list(input_ids))
        ids = self.ids[: self.cut] if self.cut else self.ids
        return Generation(output_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids),
                          finish_reason="length" if self.cut else "stop", weight_version=0,
                          token_weight_versions=tuple(0 for _ in ids), prompt_len=len(input_ids))


def test_a_model_answers_once_under_the_rows_system_message_and_tool_syntax_is_just_text(tmp_path):
    tokenizer = load_tokenizer(init_tiny())
    rows = source(write(tmp_path, "jsonl"), split_field="split").instances("train")
    seen = []
    env = PromptEnv(lambda completion, row: seen.append(completion) or float(completion == "2"))
    params = agent_params(max_turns=4, tool_schema_in_prompt=True)
    policy = Says(tokenizer, "2")
    episode = run(run_episode(rows[1], policy, tokenizer, env, params, SamplingParams(seed=0)))
    assert (episode.status, episode.reward, episode.turns) == ("ok", 1.0, 1)
    assert "Reply with a number." not in tokenizer.decode(policy.prompts[0])  # row 1 has no system message
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    policy = Says(tokenizer, call)
    episode = run(run_episode(rows[0], policy, tokenizer, env, params, SamplingParams(seed=0)))
    prompt = tokenizer.decode(policy.prompts[0])
    assert "Reply with a number." in prompt and "<tools>" not in prompt and "bash" not in prompt
    assert (episode.status, episode.reward, episode.turns, episode.tool_errors) == ("ok", 0.0, 1, 0)
    assert seen[-1] == call  # no tools: the turn is the answer, whatever it looks like
    cut = run(run_episode(rows[2], Says(tokenizer, "3 apples", cut=1), tokenizer, env, params, SamplingParams()))
    assert cut.status == "truncated" and cut.reward is not None and seen[-1] == tokenizer.decode(cut.tokens[-1:])


def test_furlong_train_and_eval_run_on_the_bundled_example(tmp_path, monkeypatch):
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--config", "recipes/prompts-arith.yaml",
                          f"train.run_dir={tmp_path / 'run'}", "train.sft.epochs=1",
                          "train.sft.instances_per_family=16", "train.rl.steps=2", "train.rl.tasks_per_step=4",
                          "train.rl.group_size=2", "train.eval.heldout_per_family=6"],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert summary["families"] == ["arith"] and summary["rl_episodes"]["started"] == 16
    assert len(records) == 6 + 16 + 6 and all(r["reward"] is not None and r["error"] is None for r in records)
    assert json.loads((tmp_path / "run" / "state.json").read_text())["phases"]["sft"]["demos"] == 16
    out = tmp_path / "oracle.jsonl"
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository's root
    assert main(["eval", "--config", "recipes/prompts-arith.yaml", "--agent", "oracle", "--split", "train",
                 "--per-family", "6", "--out", str(out)]) == 0
    # the "a + b" rows have answers, which the reward scores 1; the "a plus b" ones have none to give
    results = [json.loads(line) for line in out.read_text().splitlines()]
    answered = [r for r in results if r["status"] == "ok"]
    assert len(results) == 6 and answered and all(r["reward"] == 1.0 for r in answered)
    assert all("has no answer for the oracle agent" in r["error"] for r in results if r not in answered)
