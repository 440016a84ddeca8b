"""Task family slow-echo: run /app/work.sh, which sleeps 0.2-3 s (by seed) and prints a word, and write
its output to /app/answer.txt. The command is the same for every instance; what varies is how long the
episode's command and its verifier (which sleeps 0.1-1 s) take, so episodes finish at different times:
the family asynchronous RL (train.rl.mode=async) has something to overlap with. Deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task

INSTRUCTIONS = ["Run /app/work.sh and write its output to /app/answer.txt.",
                "Write the output of /app/work.sh to /app/answer.txt."]


def generate(seed: int, out: Path) -> None:
    rng = random.Random(f"slow-echo:{seed}")
    word, work_s, verify_s = rng.choice(WORDS), round(rng.uniform(0.2, 3.0), 2), round(rng.uniform(0.1, 1.0), 2)
    test = reward_test(f"/app/answer.txt must hold the script's word (the check itself takes {verify_s} s)",
                       f'sleep {verify_s} && [ "$(cat /app/answer.txt 2>/dev/null)" = "$(cat /tests/expected.txt)" ]')
    write_task(out, instruction=rng.choice(INSTRUCTIONS), category="pipelines", difficulty="easy",
               tags=["sleep", "family"], test_sh=test, solve_sh="bash /app/work.sh > /app/answer.txt",
               env_files={"work.sh": f"#!/bin/bash\nsleep {work_s}\necho {word}\n"},
               test_files={"expected.txt": word + "\n"})
