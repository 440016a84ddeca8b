"""Task family number-stats: the sum, maximum, minimum or count of the numbers in /app/numbers.txt.
Fixed paths; the statistic asked for decides the command, the seed decides the numbers.
Stdlib only, deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path

OPS = {  # name: (instruction templates, solution command)
    "sum": (["Write the sum of the numbers in /app/numbers.txt to /app/answer.txt.",
             "Add up the numbers in /app/numbers.txt and write the total to /app/answer.txt."],
            "awk '{ s += $1 } END { print s }' /app/numbers.txt > /app/answer.txt"),
    "max": (["Write the largest number in /app/numbers.txt to /app/answer.txt.",
             "Find the maximum of the numbers in /app/numbers.txt and write it to /app/answer.txt."],
            "sort -n /app/numbers.txt | tail -n 1 > /app/answer.txt"),
    "min": (["Write the smallest number in /app/numbers.txt to /app/answer.txt.",
             "Find the minimum of the numbers in /app/numbers.txt and write it to /app/answer.txt."],
            "sort -n /app/numbers.txt | head -n 1 > /app/answer.txt"),
    "count": (["Write how many numbers /app/numbers.txt has to /app/answer.txt.",
               "Count the numbers in /app/numbers.txt and write the count to /app/answer.txt."],
              "wc -l < /app/numbers.txt > /app/answer.txt"),
}

TASK_TOML = """version = "1.0"
[metadata]
category = "pipelines"
difficulty = "easy"
tags = ["awk", "sort", "family"]
[agent]
timeout_sec = 60.0
[verifier]
timeout_sec = 30.0
[environment]
cpus = 1
memory_mb = 512
"""

TEST_SH = """#!/bin/bash
# /app/answer.txt must hold the expected number (surrounding whitespace ignored)
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if [ -f /app/answer.txt ] && [ "$(tr -d ' \\n' < /app/answer.txt)" = "$(tr -d ' \\n' < /tests/expected.txt)" ]; then
  echo 1 > /logs/verifier/reward.txt
fi
"""


def generate(seed: int, out: Path) -> None:
    rng = random.Random(f"number-stats:{seed}")
    op = rng.choice(sorted(OPS))
    while True:
        numbers = [rng.randint(1, 999) for _ in range(rng.randint(5, 12))]
        answers = {"sum": sum(numbers), "max": max(numbers), "min": min(numbers), "count": len(numbers)}
        if len(set(answers.values())) == len(answers):  # a wrong statistic must never pass
            break
    templates, command = OPS[op]
    files = {
        "instruction.md": rng.choice(templates) + "\n",
        "task.toml": TASK_TOML,
        "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY numbers.txt /app/numbers.txt\n",
        "environment/numbers.txt": "".join(f"{x}\n" for x in numbers),
        "tests/test.sh": TEST_SH,
        "tests/expected.txt": f"{answers[op]}\n",
        "solution/solve.sh": "#!/bin/bash\n" + command + "\n",
    }
    for rel, content in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(content)
