"""Fixed batches for tests/test_fsdp2.py: synthetic episodes (random tokens, rollout logprobs near the policy's)
and demonstrations, the same on every call."""

from __future__ import annotations

import random
from dataclasses import replace

from furlong.agent.episode import Episode, EpisodeTiming
from furlong.model.chat import Message, render_prompt_ids
from furlong.train.sft import Demo


def fixed_episodes(groups: int = 3, group_size: int = 3, vocab: int = 500, seed: int = 0) -> list[Episode]:
    """Groups of varied lengths and rewards (every group has reward variance, so none is filtered)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(10, vocab) for _ in range(3 + 2 * g))
        for s in range(group_size):
            n = 2 + rng.randrange(6)
            sampled = tuple(rng.randrange(10, vocab) for _ in range(n))
            out.append(Episode(task_id=f"t{g}", group_id=g, sample_id=s, prompt_len=len(prompt),
                               tokens=prompt + sampled, loss_mask=(0,) * len(prompt) + (1,) * n,
                               rollout_logprobs=(0.0,) * len(prompt) + tuple(-6.2 + rng.random() * 0.2
                                                                             for _ in range(n)),
                               token_weight_versions=(-1,) * len(prompt) + (0,) * n, reward=float(s == 1),
                               status="ok", timing=EpisodeTiming(), turns=1))
    return out


def fixed_demos(n: int = 5, vocab: int = 500, seed: int = 1) -> tuple[Demo, ...]:
    rng = random.Random(seed)
    demos = []
    for i in range(n):
        length = 6 + 3 * i
        demos.append(Demo(task_id=f"d{i}", tokens=tuple(rng.randrange(10, vocab) for _ in range(length)),
                          loss_mask=(0,) * 3 + (1,) * (length - 3)))
    return tuple(demos)


def prompted_episodes(tokenizer, **kw) -> list[Episode]:
    """fixed_episodes whose prompts are real ones (a system and a user message, kept on the episode and rendered
    by `tokenizer` as the agent does), so a self-distillation teacher can render them under its own prompt."""
    out = []
    for e in fixed_episodes(**kw):
        prompt = (Message("system", "You are an agent."), Message("user", "count the files " * (1 + 2 * e.group_id)))
        ids = tuple(render_prompt_ids(tokenizer, prompt))
        p, n = len(ids), e.response_len
        out.append(replace(e, prompt=prompt, prompt_len=p, tokens=ids + e.tokens[e.prompt_len:],
                           loss_mask=(0,) * p + (1,) * n, rollout_logprobs=(0.0,) * p + e.rollout_logprobs[-n:],
                           token_weight_versions=(-1,) * p + (0,) * n))
    return out
