"""Builders for `furlong eval --agent model`: the engine over a checkpoint, its tokenizer and the agents."""

from __future__ import annotations

from furlong.agent.episode import AgentParams
from furlong.agent.harness import HarnessAgents, program
from furlong.config import Config
from furlong.engine.base import EngineUnavailable
from furlong.engine.factory import make_engine
from furlong.eval.model import ModelAgents
from furlong.model.chat import ChatTemplateError
from furlong.model.toolcall import tool_format


def model_agents(cfg: Config) -> ModelAgents | HarnessAgents:
    """The engine (eval.engine) over eval.model (+ eval.adapter) and its tokenizer; the flags must have
    passed check_model_flags. With train.agent.harness set, that program is the agent, through a gateway
    on the engine."""
    import torch

    from furlong.model.loading import ModelLoadError, load_tokenizer

    e = cfg.eval
    assert e.model is not None  # check_model_flags ran
    torch.set_num_threads(cfg.train.torch_threads)
    harness = cfg.train.agent.harness.command
    if harness is not None:
        program(harness)  # a program that is not there fails before the model loads
    try:
        tokenizer = load_tokenizer(e.model)  # first: a checkpoint without a chat template fails before loading
        tool_format(tokenizer, cfg.train.agent.tool_format)  # ... and so does one whose tool calls cannot be read
        engine = make_engine(e.engine, e.model, adapter=e.adapter, seed=e.seed)
    except (ModelLoadError, ChatTemplateError) as exc:  # the CLI prints EngineUnavailable as one line
        raise EngineUnavailable(f"--model: {exc}") from None
    params = AgentParams.of(cfg.train.agent)
    if harness is not None:
        return HarnessAgents(engine, tokenizer, params, harness, owns_engine=True)
    return ModelAgents(engine, tokenizer, params, e.temperature, e.seed)
