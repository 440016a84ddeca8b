"""Task family csv-column-sum: Sum one named column of a generated CSV file and write the total to a file (awk).

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


COLUMNS = ["price", "qty", "weight", "score", "visits", "height", "age", "points", "cost", "stock", "clicks", "rank"]


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    cols = ["id"] + rng.sample(COLUMNS, rng.randint(2, 5))
    idx = rng.randint(2, len(cols))  # 1-based, never the id column
    target = cols[idx - 1]
    rows = [[str(i + 1)] + [str(rng.randint(-50 if rng.random() < 0.2 else 0, 999)) for _ in cols[1:]]
            for i in range(rng.randint(4, 30))]
    total = sum(int(r[idx - 1]) for r in rows)
    src = f"{rng.choice(WORDS)}.csv"
    dst = f"{target}_sum.txt"
    text = ",".join(cols) + "\n" + "".join(",".join(r) + "\n" for r in rows)
    write_task(
        out,
        instruction=(f"`/app/{src}` is a CSV file with a header row. Write the sum of column {idx} "
                     f"(named `{target}`) over all data rows to `/app/{dst}`, as a plain integer."),
        category="pipelines", difficulty="medium", tags=["csv", "awk", "arithmetic"],
        env_files={src: text},
        test_sh=reward_test(f"/app/{dst} must hold {total}, the sum of column {target} of /app/{src}.",
                            f"[ \"$(tr -d '[:space:]' < /app/{dst})\" = \"{total}\" ]"),
        solve_sh=f"awk -F, 'NR > 1 {{ s += ${idx} }} END {{ print s }}' /app/{src} > /app/{dst}",
        agent_timeout=120.0,
    )
