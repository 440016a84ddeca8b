"""Task family sort-numbers: Sort the integers of a given file numerically into a given output file (sort -n).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, python_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    src = f"{rng.choice(['numbers', 'scores', 'values', 'sizes'])}_{rng.choice(WORDS)}.txt"
    dst = f"sorted_{rng.choice(WORDS)}.txt"
    nums = [rng.randint(1, 10 ** rng.randint(1, 5)) for _ in range(rng.randint(5, 25))]
    nums += [rng.randint(1, 9), rng.randint(100, 999)]  # mixed widths: a text sort gives a wrong order
    rng.shuffle(nums)
    order = "descending" if rng.random() < 0.3 else "ascending"
    want = sorted(nums, reverse=order == "descending")
    check = (
        "import sys\n"
        f"want = {want!r}\n"
        "try:\n"
        f"    got = [int(x) for x in open('/app/{dst}').read().split()]\n"
        "except (OSError, ValueError) as e:\n"
        "    sys.exit(f'cannot read /app/{dst}: {{e}}')\n"
        "sys.exit(0 if got == want else f'got {{got}}, want {{want}}')\n"
    )
    write_task(
        out,
        instruction=(f"Sort the numbers in `/app/{src}` (one per line) in {order} numeric order and write them, "
                     f"one per line, to `/app/{dst}`."),
        category="pipelines", difficulty="easy", tags=["sort", "simple"],
        env_files={src: "".join(f"{n}\n" for n in nums)},
        test_files={"check.py": check},
        test_sh=python_test(f"/app/{dst} must list the numbers of /app/{src} in {order} numeric order."),
        solve_sh=f"sort -n{'r' if order == 'descending' else ''} /app/{src} > /app/{dst}",
    )
