"""Task family number-stats: the sum, maximum, minimum or count of the numbers in /app/numbers.txt.
Fixed paths; the statistic asked for decides the command, the seed decides the numbers.
Deterministic per seed."""

from __future__ import annotations

from pathlib import Path

from furlong.tasks.kit import number_instance

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


def generate(seed: int, out: Path) -> None:
    number_instance("number-stats", OPS, ["awk", "sort", "family"], seed, out)
