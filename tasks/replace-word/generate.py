"""Task family replace-word: Replace every occurrence of a given word with another in a given file (sed -i s///g).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    old, new = rng.sample(WORDS, 2)
    filler = [w for w in WORDS if w not in (old, new)]
    name = f"{rng.choice(['story', 'poem', 'notes', 'draft', 'letter'])}{rng.randint(1, 99)}.txt"
    lines = []
    for _ in range(rng.randint(3, 10)):
        words = [rng.choice(filler) for _ in range(rng.randint(3, 8))]
        for _ in range(rng.choice([0, 1, 1, 2])):
            words.insert(rng.randint(0, len(words)), old)
        lines.append(" ".join(words))
    if not any(old in line.split() for line in lines):
        lines[0] += " " + old
    text = "\n".join(lines) + "\n"
    expected = "\n".join(" ".join(new if w == old else w for w in line.split()) for line in lines) + "\n"
    write_task(
        out,
        instruction=f"In the file `/app/{name}`, replace every occurrence of the word `{old}` with `{new}`.",
        category="files-text", difficulty="easy", tags=["sed", "text", "simple"],
        env_files={name: text},
        test_files={"expected.txt": expected},
        test_sh=reward_test(f"/app/{name} must equal the text with every {old} replaced by {new}.",
                            f'[ "$(cat /app/{name})" = "$(cat /tests/expected.txt)" ]'),
        solve_sh=f"sed -i 's/{old}/{new}/g' /app/{name}",
    )
