"""Task family sum-two-numbers: Write the sum of two given integers to a given file.

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    dst = f"/app/{rng.choice(['sum', 'answer', 'result', 'total'])}_{rng.choice(WORDS)}.txt"
    write_task(
        out,
        instruction=f"Write the sum of {a} and {b} to the file {dst} as a plain number.",
        category="files-text", difficulty="easy", tags=["arithmetic", "echo", "simple"],
        test_sh=reward_test(f"{dst} must hold {a + b}.", f"[ \"$(tr -d '[:space:]' < {dst})\" = \"{a + b}\" ]"),
        solve_sh=f"echo $(( {a} + {b} )) > {dst}",
    )
