"""A Python environment: guess a secret number with a `guess` tool, told "higher" or "lower" each time.

    furlong train --config examples/guess_number.yaml

An instance is a (seed, split): the secret is drawn from them, so a GRPO group's episodes all chase the
same number, and held-out secrets come from other draws than train ones. The reward is 1 for the guess
that finds it; the episode is done then, or when the guesses run out. A turn without a tool call gets a
reminder, and the conversation goes on (the model's limits, train.agent.max_turns, still end it).
`demonstrate` gives SFT a bisection to imitate, so that RL starts from a model that calls the tool.
"""

from __future__ import annotations

import random

from furlong.envs.user import Action

GUESS = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret number; the answer says higher, lower or correct.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}


class GuessNumber:
    tools = [GUESS]
    low, high, tries = 1, 100, 7

    def reset(self, seed: int, split: str) -> str:
        self.secret = random.Random(f"{split}-{seed}").randint(self.low, self.high)
        self.left = self.tries
        return (f"I picked a whole number from {self.low} to {self.high}. Find it with the guess tool; "
                f"you have {self.tries} guesses.")

    def step(self, action: Action) -> tuple[str, float, bool]:
        if action.tool != "guess":
            return "Use the guess tool, e.g. guess(number=50).", 0.0, False
        number = action.arguments["number"]
        self.left -= 1
        if number == self.secret:
            return "correct", 1.0, True
        hint = "higher" if number < self.secret else "lower"
        return f"{hint} ({self.left} guesses left)", 0.0, self.left == 0

    def demonstrate(self) -> list[Action]:
        """SFT's demonstration of this instance (train.env.demonstrations): the guesses of a bisection, which
        finds any secret of 1..100 within the 7 tries; furlong replays them through `step`."""
        low, high, moves = self.low, self.high, []
        while True:
            guess = (low + high) // 2
            moves.append(Action(tool="guess", arguments={"number": guess}))
            if guess == self.secret:
                return moves
            low, high = (guess + 1, high) if guess < self.secret else (low, guess - 1)
