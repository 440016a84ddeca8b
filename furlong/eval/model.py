"""`furlong eval --agent model`: any local Hugging Face checkpoint (optionally with a PEFT adapter) as
the agent, in the very loop training uses: each episode is a `furlong.agent.episode.ModelAgent`
conversation (same prompt, tool-call format and limits, `train.agent.*`) run by the one episode runner.

Each of a task's `samples` episodes samples with its own seed, `furlong.seeding.eval_seed(eval.seed, task
id, sample)` (not the task's position in the suite), so adding tasks changes no other task's samples, a
rerun gives the same episodes, and training's held-out eval (the same rule, with train.eval.seed) is
reproduced by `furlong eval` on the same checkpoint.
"""

from __future__ import annotations

from furlong.agent.episode import AgentParams, ModelAgent
from furlong.config import EvalConfig
from furlong.engine.base import Engine, SamplingParams
from furlong.engine.factory import check_checkpoint
from furlong.seeding import eval_seed
from furlong.tasks.model import Task


def check_model_flags(e: EvalConfig) -> None:
    """Before any image is built: the flags make sense and the directories are checkpoints (one-line errors)."""
    if e.agent != "model":
        if e.model is not None or e.adapter is not None:
            raise ValueError(
                f"--model/--adapter (eval.model, eval.adapter) are only used with --agent model, not --agent {e.agent}"
            )
        return
    if e.model is None:
        raise ValueError("--agent model needs --model DIR (eval.model): a local Hugging Face checkpoint directory")
    check_checkpoint(e.model, "--model")
    if e.adapter is not None:
        check_checkpoint(e.adapter, "--adapter", "adapter_config.json")


class ModelAgents:
    """A fresh ModelAgent per episode (furlong.eval.agents.EpisodeAgents), all sharing one engine, which
    batches every concurrent episode's generation requests."""

    name = "model"

    def __init__(self, engine: Engine, tokenizer, params: AgentParams, temperature: float, seed: int):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.temperature, self.seed = temperature, seed

    def for_episode(self, task: Task, sample: int) -> ModelAgent:
        sampling = SamplingParams(temperature=self.temperature, seed=eval_seed(self.seed, task.id, sample))
        return ModelAgent(self.engine, self.tokenizer, self.params, sampling, task.instruction)

    async def close(self) -> None:
        close = getattr(self.engine, "close", None)  # the Engine protocol does not require one
        if close is not None:
            await close()
