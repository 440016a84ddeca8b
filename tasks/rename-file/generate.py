"""Task family rename-file: Rename a given file to a given new name (mv).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    w1, w2 = rng.sample(WORDS, 2)
    ext = rng.choice([".txt", ".log", ".csv", ".md", ""])
    old, new = f"{w1}{ext}", f"{w2}_{rng.randint(1, 99)}{ext}"
    token = f"{rng.choice(WORDS)}-{rng.randint(1000, 9999)}"
    write_task(
        out,
        instruction=f"Rename the file /app/{old} to /app/{new} and keep its content.",
        category="files-text", difficulty="easy", tags=["mv", "files", "simple"],
        env_files={old: token + "\n"},
        test_sh=reward_test(f"/app/{old} must be gone and /app/{new} must hold its content ({token}).",
                            f'[ ! -e /app/{old} ] && [ "$(cat /app/{new})" = "{token}" ]'),
        solve_sh=f"mv /app/{old} /app/{new}",
    )
