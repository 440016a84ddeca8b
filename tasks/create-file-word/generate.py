"""Task family create-file-word: Create a file with a given name containing a given word (one echo).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    name = f"{rng.choice(WORDS)}{rng.randint(1, 99)}{rng.choice(['.txt', '.txt', '', '.md'])}"
    word = rng.choice(WORDS)
    path = f"/app/{name}"
    write_task(
        out,
        instruction=f"Create the file {path} containing exactly the word {word} and nothing else.",
        category="files-text", difficulty="easy", tags=["echo", "files", "simple"],
        test_sh=reward_test(f"{path} must contain exactly {word} (a trailing newline is fine).",
                            f'[ -f {path} ] && [ "$(cat {path})" = "{word}" ]'),
        solve_sh=f"echo {word} > {path}",
    )
