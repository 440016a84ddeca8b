"""A check environment for scripts/train_check.py: one reply, rewarded by how close it comes to a word.

The reward is graded (difflib's similarity ratio, 0..1), so an untrained model's group of replies already
differs in reward and every RL step trains: a run on it exercises the trainer, the weight sync and the
engine on any device within seconds. It is a smoke test of the machinery, not a task worth learning.
"""

from __future__ import annotations

import difflib
import random

from furlong.envs.user import Action

WORDS = ("apple", "river", "stone", "cloud", "garden", "silver", "window", "orange")


class SayTheWord:
    def reset(self, seed: int, split: str) -> str:
        self.word = random.Random(f"{split}-{seed}").choice(WORDS)
        return f"Reply with the single word {self.word}."

    def step(self, action: Action) -> tuple[str, float, bool]:
        said = (action.text or "").strip().lower()
        return "done", round(difflib.SequenceMatcher(None, said, self.word).ratio(), 4), True
