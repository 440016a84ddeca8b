"""Task family number-stats: the sum, maximum, minimum or count of the numbers in /app/numbers.txt.
Fixed paths; the statistic asked for decides the command, the seed decides the numbers.
Deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import reward_test, write_task

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

TEST_SH = reward_test("/app/answer.txt must hold the expected number (surrounding whitespace ignored)",
                      '[ -f /app/answer.txt ] && [ "$(tr -d \' \\n\' < /app/answer.txt)" = "$(tr -d \' \\n\' < /tests/expected.txt)" ]')


def generate(seed: int, out: Path) -> None:
    rng = random.Random(f"number-stats:{seed}")
    op = rng.choice(sorted(OPS))
    while True:
        numbers = [rng.randint(1, 999) for _ in range(rng.randint(5, 12))]
        answers = {"sum": sum(numbers), "max": max(numbers), "min": min(numbers), "count": len(numbers)}
        if len(set(answers.values())) == len(answers):  # a wrong statistic must never pass
            break
    templates, command = OPS[op]
    write_task(out, instruction=rng.choice(templates), category="pipelines", difficulty="easy",
               tags=["awk", "sort", "family"], test_sh=TEST_SH, solve_sh=command,
               env_files={"numbers.txt": "".join(f"{x}\n" for x in numbers)}, test_files={"expected.txt": f"{answers[op]}\n"})
