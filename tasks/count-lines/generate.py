"""Task family count-lines: Count the lines of a given file and write the number to a given file (wc -l).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    src = f"{rng.choice(WORDS)}_{rng.choice(['list', 'log', 'notes', 'items', 'data'])}.txt"
    dst = f"{rng.choice(['count', 'lines', 'answer', 'total', 'n'])}{rng.randint(1, 9)}.txt"
    n = rng.randint(3, 60)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) for _ in range(n)]
    write_task(
        out,
        instruction=f"Count the lines in `/app/{src}` and write just the number to `/app/{dst}`.",
        category="pipelines", difficulty="easy", tags=["wc", "simple"],
        env_files={src: "\n".join(lines) + "\n"},
        test_sh=reward_test(f"/app/{dst} must hold the line count of /app/{src}, {n}.",
                            f"[ \"$(tr -d '[:space:]' < /app/{dst})\" = \"{n}\" ]"),
        solve_sh=f"wc -l < /app/{src} > /app/{dst}",
    )
