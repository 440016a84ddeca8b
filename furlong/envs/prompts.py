"""A prompt dataset as furlong's environment (furlong.envs.base): single-turn RL with verifiable rewards,
no sandbox and no tools (`train.env.prompts`; docs/prompts.md).

Each row is one instance: its prompt is the user message (after the row's own system message, if it has
one), the model answers once, and the user's reward function `reward(completion: str, row: dict) -> float`
scores that answer, with every field of the row. The rows come from furlong.envs.prompt_data.

A reward function that raises, runs past its timeout or returns anything but a finite number gives no
reward: the episode is infra_error (never scored, never trained on), its error the traceback. The rule of
furlong.envs.rewards (a control run on an untouched episode decides whose fault a failure is) has nothing
to judge here: there is no environment an agent could break, only the text it wrote, so a function that
fails on a completion has a bug (catch what it cannot parse, and return 0 for it). The run counts these
episodes in every phase's `infra_error`, so they are never silent.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from furlong.envs.base import Score, ToolError
from furlong.envs.prompt_data import DatasetError, Row, text_field
from furlong.envs.rewards import RewardFailed, failure_text, finite_number
from furlong.envs.toolset import call_user
from furlong.timing import Clock

SPLITS = ("train", "heldout")
RewardCall = Callable[[str, dict], Any]  # reward(completion, row) -> a number, sync or async


@dataclass(frozen=True)
class Fields:
    """Which fields of a row are what (train.env.prompts.*_field)."""

    prompt: str = "prompt"
    system: str | None = "system"
    answer: str | None = None


@dataclass(frozen=True)
class PromptRow:
    """One row of a prompt dataset (an EnvSpec)."""

    id: str
    instruction: str  # the prompt
    family: str
    split: str
    where: str  # the row's file and row number
    values: Mapping[str, Any] = field(repr=False)  # every field: what the reward function gets
    system_prompt: str | None = None  # the episode's system message, in place of train.agent.system_prompt
    answer: str | None = None  # a reference completion: SFT's demonstration, `--agent oracle`'s answer
    agent_timeout_s: float = 600.0
    seed: int | None = None  # a row is not drawn from a seed (an EnvSpec's optional field, in eval records)


def prompt_row(row: Row, fields: Fields, family: str, split: str, index: int, agent_timeout_s: float) -> PromptRow:
    """`row` checked against `fields`: DatasetError naming its file, row and field when it does not fit."""
    prompt = text_field(row, fields.prompt, "the prompt", required=True)
    system = text_field(row, fields.system, "the system message", required=False) if fields.system else None
    answer = (
        text_field(row, fields.answer, "the reference answer", required=False, numbers=True) if fields.answer else None
    )
    return PromptRow(
        id=f"{family}/{split}-{index}",
        instruction=prompt or "",
        family=family,
        split=split,
        where=row.where,
        values=row.values,
        system_prompt=system,
        answer=answer,
        agent_timeout_s=agent_timeout_s,
    )


class PromptSource:
    """The rows of each split as instances (an EnvSource), checked when it is made; held-out rows capped at
    `limits["heldout"]` (the first ones), where given."""

    def __init__(
        self,
        tables: Mapping[str, Sequence[Row]],
        fields: Fields,
        family: str,
        agent_timeout_s: float,
        limits: Mapping[str, int] | None = None,
    ):
        self.family, self.limits = family, dict(limits or {})
        self.rows = {
            split: [
                prompt_row(r, fields, family, split, k, agent_timeout_s) for k, r in enumerate(tables.get(split, ()))
            ]
            for split in SPLITS
        }
        for split in SPLITS:
            if not self.rows[split]:
                raise DatasetError(f"prompt dataset {family!r}: no {split} rows (check its split settings)")
        if fields.answer and not any(r.answer is not None for r in self.rows["train"]):
            raise DatasetError(f"prompt dataset {family!r}: no train row has the answer field {fields.answer!r}")

    def instances(self, split: str) -> list[PromptRow]:
        if split == "all":
            return self.instances("train") + self.instances("heldout")
        rows = self.rows[split]
        return rows[: self.limits[split]] if split in self.limits else list(rows)


class PromptEnv:
    """Opens each episode of a prompt dataset (furlong.envs.base.Environment): nothing to start, the
    reward function to score it."""

    def __init__(self, reward: RewardCall, timeout_s: float = 30.0):
        self.reward, self.timeout_s = reward, timeout_s

    def reserve(self, spec: PromptRow) -> None:
        """Nothing to start ahead."""

    async def open(self, spec: PromptRow, clock: Clock) -> PromptEpisode:
        clock.add("sandbox_start", time.perf_counter())
        return PromptEpisode(spec, self)


class PromptEpisode:
    """One episode (furlong.envs.base.EpisodeEnv), and its toolbox: no tools; the model's one turn is the
    completion, after which the conversation ends."""

    note = None
    schemas: Sequence[dict] = ()
    seconds, calls = 0.0, 0

    def __init__(self, spec: PromptRow, opened_by: PromptEnv):
        self.spec, self.opened_by, self.tools = spec, opened_by, self
        self.completion: str | None = None

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        raise ToolError("this environment has no tools: answer in text")

    async def reply(self, text: str, timeout_s: float) -> None:
        """The completion; None: one answer ends the conversation."""
        if self.completion is None:
            self.completion = text

    @property
    def finished(self) -> bool:
        return self.completion is not None

    def caused(self, exc: BaseException) -> bool:
        return False  # nothing here can fail under the agent: what raises is the agent's own code

    async def score(self) -> Score:
        """The reward function on the completion ("" if the agent never answered) and a copy of the row."""
        env, completion = self.opened_by, self.completion or ""
        try:
            value = await call_user(
                env.reward, completion, copy.deepcopy(dict(self.spec.values)), timeout_s=env.timeout_s
            )
            return Score(reward=finite_number(value, "the reward function"))
        except TimeoutError:
            return Score(
                reward=None, error=f"the reward function timed out after {env.timeout_s:g}s ({self.spec.where})"
            )
        except RewardFailed as exc:
            return Score(reward=None, error=f"{exc} ({self.spec.where})")
        except Exception as exc:  # noqa: BLE001 -- user code: any failure is this episode's error, not a crash
            return Score(reward=None, error=f"the reward function raised ({self.spec.where}):\n{failure_text(exc)}")

    async def close(self) -> None:
        """Nothing to close."""
