"""Task family grep-count: Count the lines of a file that contain a given word and write the count to a file (grep -c).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    word = rng.choice(WORDS)
    filler = [w for w in WORDS if w != word]
    src = f"{rng.choice(['server', 'app', 'events', 'build', 'access'])}{rng.randint(1, 9)}.log"
    dst = f"{word}_count.txt"
    levels = ["INFO", "WARN", "ERROR", "DEBUG"]
    lines, count = [], 0
    for i in range(rng.randint(8, 40)):
        words = [rng.choice(filler) for _ in range(rng.randint(2, 6))]
        hits = rng.choice([0, 0, 0, 1, 1, 2])  # some lines mention the word twice: count lines, not words
        for _ in range(hits):
            words.insert(rng.randint(0, len(words)), word)
        count += hits > 0
        lines.append(f"{i + 1:04d} {rng.choice(levels)} " + " ".join(words))
    if count == 0:
        lines[-1] += " " + word
        count = 1
    write_task(
        out,
        instruction=f"Count how many lines of `/app/{src}` contain the word `{word}`, and write just that number to `/app/{dst}`.",
        category="pipelines", difficulty="easy", tags=["grep", "simple"],
        env_files={src: "\n".join(lines) + "\n"},
        test_sh=reward_test(f"/app/{dst} must hold {count}, the number of lines of /app/{src} containing {word}.",
                            f"[ \"$(tr -d '[:space:]' < /app/{dst})\" = \"{count}\" ]"),
        solve_sh=f"grep -c {word} /app/{src} > /app/{dst}",
    )
