"""The bundled prompt dataset's reward (docs/prompts.md): 1 when the completion is the sum of the row's
`a` and `b`, written as a number (surrounding spaces and a final period allowed), else 0.

    train.env.prompts.reward: examples/prompts_arith/reward.py
"""

from __future__ import annotations


def reward(completion: str, row: dict) -> float:
    answer = completion.strip().rstrip(".").strip()
    return 1.0 if answer == str(row["a"] + row["b"]) else 0.0
