"""Task family append-line: Append a given line to the end of a given existing file (echo >>).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    name = f"{rng.choice(WORDS)}_{rng.choice(['notes', 'todo', 'list', 'log'])}.txt"
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 8))]
    new = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    original = "\n".join(lines) + "\n"
    write_task(
        out,
        instruction=f"Append the line {new} to the end of the file /app/{name} and keep the existing lines.",
        category="files-text", difficulty="easy", tags=["echo", "append", "simple"],
        env_files={name: original},
        test_files={"expected.txt": original + new + "\n"},
        test_sh=reward_test(f"/app/{name} must be its original lines plus '{new}'.",
                            f'[ "$(cat /app/{name})" = "$(cat /tests/expected.txt)" ]'),
        solve_sh=f"echo {new} >> /app/{name}",
    )
