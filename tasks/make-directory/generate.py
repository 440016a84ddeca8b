"""Task family make-directory: Create a given (possibly nested) directory (mkdir -p).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    parts = [f"{w}{rng.randint(1, 9) if rng.random() < 0.3 else ''}" for w in rng.sample(WORDS, rng.randint(1, 3))]
    path = "/app/" + "/".join(parts)
    write_task(
        out,
        instruction=f"Create the directory {path} and any missing parents.",
        category="files-text", difficulty="easy", tags=["mkdir", "files", "simple"],
        test_sh=reward_test(f"{path} must be a directory.", f"[ -d {path} ]"),
        solve_sh=f"mkdir -p {path}",
    )
