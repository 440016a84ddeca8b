"""Held-out evals, your own environment (Python, prompt datasets, reward functions) and logging."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from furlong.config.base import _Node


class TrainEvalConfig(_Node):
    heldout_per_family: int = Field(
        64, ge=1, description="held-out instances of each family, one episode each (the bundled families have 128)"
    )
    temperature: float = Field(1.0, ge=0, description="pass@1 is measured by sampling at this temperature")
    seed: int = Field(1234, description="sampling seeds of held-out episodes derive from this")
    concurrency: int = Field(16, ge=1, description="held-out episodes (sandboxes) at once")


class RewardConfig(_Node):
    """One reward function of `train.env.rewards` (furlong.envs.rewards): a Python callable or a command,
    weighed into the episode's reward."""

    python: str | None = Field(
        None,
        description='"module:function" on the Python path, called with the finished '
        "episode (furlong.envs.rewards.EpisodeView), sync or async; returns a number",
    )
    command: str | None = Field(
        None,
        description="run in the episode's sandbox as the verifier, after the tests "
        "(Harbor tasks only); the last line of its output is the value",
    )
    weight: float = Field(1.0, description="its weight in the episode's reward")
    timeout_s: float = Field(60.0, gt=0, description="past this it has failed (the failure rule: docs/environments.md)")
    params: dict[str, Any] = Field(
        {},
        description="python: what the function sees as `episode.params` (a "
        "budget, a target length), so one function serves several entries",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if (self.python is None) == (self.command is None):
            raise ValueError("give exactly one of python and command")
        if self.params and self.command is not None:
            raise ValueError("params: only a python function sees them; a command has none")
        return self


class PromptsConfig(_Node):
    """A prompt dataset for single-turn RL with a Python reward function, instead of Harbor tasks: each row a
    prompt, the model answers once, `reward(completion, row)` scores it; no sandbox, no tools
    (furlong.envs.prompts; docs/prompts.md). On when `path`, or `train_path` and `heldout_path`, are set."""

    path: Path | None = Field(
        None,
        description="one dataset holding both splits: a JSONL or Parquet file, or a "
        "Hugging Face datasets directory (save_to_disk, or a folder of data files); its "
        "held-out rows by split_field, heldout_fraction, or a DatasetDict's own splits",
    )
    train_path: Path | None = Field(None, description="instead of path: the train rows (one table)")
    heldout_path: Path | None = Field(None, description="with train_path: the held-out rows (one table)")
    format: Literal["auto", "jsonl", "parquet", "hf"] = Field(
        "auto", description="auto: by the suffix (.jsonl, .ndjson, .json: JSONL; .parquet), a directory is hf"
    )
    prompt_field: str = Field("prompt", description="the field holding the prompt (the user message, a string)")
    system_field: str | None = Field(
        "system",
        description="a row's own system message where it has this field "
        "(a string), in place of train.agent.system_prompt; null: never",
    )
    answer_field: str | None = Field(
        None,
        description="a reference completion (a string or number): SFT "
        "demonstrates it where the reward function gives it 1, `furlong eval --agent "
        "oracle` answers it. null: no SFT (train.sft.epochs, train.rl.sft_coef 0)",
    )
    split_field: str | None = Field(
        None,
        description="path: the field naming each row's split (its values: splits); rows of other values are left out",
    )
    splits: dict[str, str] = Field(
        {"train": "train", "heldout": "test"},
        description="furlong's split -> the split_field value, or the DatasetDict split, that holds its rows",
    )
    heldout_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="path, one table, no split_field: hold out this fraction of the rows, drawn with a fixed seed",
    )
    reward: str | None = Field(
        None,
        description='the reward function: "module:function" on the Python path, or '
        '"FILE.py" / "FILE.py:function" (default name `reward`); reward(completion: str, '
        "row: dict) -> float, sync or async",
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="one reward call; past it the episode is infra_error")
    name: str | None = Field(
        None,
        description="the family of its instances (reports, summary.json); null: the "
        "dataset's file or directory name without its suffix",
    )

    @property
    def active(self) -> bool:
        return self.path is not None or self.train_path is not None or self.heldout_path is not None

    @model_validator(mode="after")
    def _one_source(self) -> PromptsConfig:
        if not self.active:
            return self
        if self.path is not None and (self.train_path or self.heldout_path):
            raise ValueError("give path, or train_path and heldout_path, not both")
        if self.path is None and (self.train_path is None or self.heldout_path is None):
            raise ValueError("train_path and heldout_path: give both (or path, for one dataset with both splits)")
        if self.path is None and (self.split_field or self.heldout_fraction):
            raise ValueError(
                "split_field and heldout_fraction split path's rows; train_path and heldout_path are already split"
            )
        if self.split_field and self.heldout_fraction:
            raise ValueError("split_field or heldout_fraction: one way to pick the held-out rows")
        if set(self.splits) != {"train", "heldout"}:
            raise ValueError(f"splits: expected the keys train and heldout, got {sorted(self.splits)}")
        if self.reward is None:
            raise ValueError('reward: the reward function is needed ("module:function" or "FILE.py")')
        return self

    def family(self) -> str:
        source = self.path or self.train_path
        return self.name or (source.stem if source is not None else "prompts")


class EnvConfig(_Node):
    """Your own environment, tools and reward functions, for training, its held-out evals and `furlong eval`
    (docs/environments.md)."""

    python: str | None = Field(
        None,
        description='"module:factory" on the Python path: a Python environment '
        "(reset/step) instead of Harbor tasks; its family is the factory's name. null: the "
        "Harbor tasks of train.tasks and train.families",
    )
    openenv: bool = Field(
        False,
        description="episodes on the OpenEnv server of the `openenv` section instead of "
        "Harbor tasks (docs/openenv.md; no oracle demonstrations: train.sft.epochs and "
        "train.rl.sft_coef must be 0)",
    )
    prompts: PromptsConfig = Field(
        PromptsConfig(),
        description="a prompt dataset and its reward function instead of Harbor tasks (single-turn, no sandbox)",
    )
    train_instances: int = Field(
        128,
        ge=1,
        description="python: train instances (seeds 0..N-1 of split train); "
        "held-out ones: train.eval.heldout_per_family",
    )
    agent_timeout_s: float = Field(
        600.0,
        gt=0,
        description="python and prompts: an episode's time limit for the agent (a Harbor task's is in its task.toml)",
    )
    tools: tuple[str, ...] = Field(
        (),
        description='"module:attribute" of each furlong.envs.toolset.Tool (or a list '
        "of them): tools beside bash (Harbor) or the environment's own (python)",
    )
    rewards: dict[str, RewardConfig] = Field(
        {},
        description="reward functions by name (their keys in the episode's "
        "rewards), each as in train.env.rewards.<name>",
    )
    tests_weight: float = Field(
        1.0,
        description="weight of the environment's own reward beside train.env.rewards "
        "(Harbor: the tests'; python: its steps' rewards summed)",
    )
    demonstrations: bool = Field(
        False,
        description="python: SFT (and RL's anchor) shows the environment's own "
        "demonstrations, each instance's `demonstrate()` Actions replayed through it (kept "
        "where they earn 1); false: no SFT, as there is no oracle",
    )

    @model_validator(mode="after")
    def _names(self) -> EnvConfig:
        if reserved := sorted(set(self.rewards) & {"reward", "tests", "steps"}):
            raise ValueError(f"rewards: the names {reserved} are reserved for the episode's own rewards")
        chosen = [
            k
            for k, on in (
                ("python", self.python is not None),
                ("openenv", self.openenv),
                ("prompts", self.prompts.active),
            )
            if on
        ]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)}: one environment at a time")
        if self.prompts.active and (self.tools or self.rewards):
            raise ValueError(
                "tools and rewards: a prompt dataset has no tools, and its one reward is "
                "prompts.reward (weigh your terms inside it)"
            )
        if self.demonstrations and self.python is None:
            raise ValueError(
                "demonstrations: a Python environment's (train.env.python); Harbor tasks have their "
                "oracle solutions, a prompt dataset its answer_field"
            )
        if self.python is not None and ":" not in self.python:
            raise ValueError(f'python: expected "module:factory", got {self.python!r}')
        return self

    def family(self) -> str | None:
        """The one family of a Python environment's instances (its factory's name) or a prompt dataset's."""
        if self.prompts.active:
            return self.prompts.family()
        return None if self.python is None else self.python.rpartition(":")[2]

    def demonstrable(self) -> bool:
        """Whether SFT has demonstrations in this environment: a prompt dataset's answers; a Python
        environment's own, where it gives them; Harbor tasks' oracle solutions (an OpenEnv server's:
        TrainConfig's rule)."""
        if self.prompts.active:
            return self.prompts.answer_field is not None
        return self.python is None or self.demonstrations


class WandbConfig(_Node):
    """Weights & Biases, beside metrics.jsonl and TensorBoard: the same rows, each key as `<phase>/<key>`."""

    enabled: bool = Field(
        False, description="log to W&B too (the wandb package: pip install wandb); off, wandb is never imported"
    )
    project: str = Field("furlong", description="the W&B project")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: files only (upload later with `wandb sync`); online: to the W&B server (needs a login)",
    )
    dir: Path | None = Field(None, description="where wandb writes its files; null: the run directory")


class LogConfig(_Node):
    """Where a run's metrics go beside RUN_DIR/metrics.jsonl and TensorBoard's RUN_DIR/tb."""

    wandb: WandbConfig = Field(WandbConfig(), description="Weights & Biases")
