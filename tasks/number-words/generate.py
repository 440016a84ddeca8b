"""Task family number-words (reward-only by default): number-stats' four statistics, asked in other words.

The default SFT never shows this family's demonstrations; a policy that learned number-stats' commands
knows *how* to compute each statistic but not which of this family's words asks for which, so it must
learn that from the verifier's reward. Every instance has its own numbers, so no answer carries over,
and a policy that always runs one command passes about a quarter of the instances.
Deterministic per seed."""

from __future__ import annotations

from pathlib import Path

from furlong.tasks.kit import number_instance

OPS = {  # name: (instruction templates, solution command); number-stats says sum/total, largest/maximum, ...
    "sum": (["Write the grand total of the numbers in /app/numbers.txt to /app/answer.txt.",
             "Tot up the numbers in /app/numbers.txt and write what they come to in /app/answer.txt."],
            "awk '{ s += $1 } END { print s }' /app/numbers.txt > /app/answer.txt"),
    "max": (["Write the biggest number in /app/numbers.txt to /app/answer.txt.",
             "Find the highest of the numbers in /app/numbers.txt and write it to /app/answer.txt."],
            "sort -n /app/numbers.txt | tail -n 1 > /app/answer.txt"),
    "min": (["Write the lowest number in /app/numbers.txt to /app/answer.txt.",
             "Find the least of the numbers in /app/numbers.txt and write it to /app/answer.txt."],
            "sort -n /app/numbers.txt | head -n 1 > /app/answer.txt"),
    "count": (["Write the tally of numbers in /app/numbers.txt to /app/answer.txt.",
               "Tally the numbers in /app/numbers.txt and write the tally to /app/answer.txt."],
              "wc -l < /app/numbers.txt > /app/answer.txt"),
}


def generate(seed: int, out: Path) -> None:
    number_instance("number-words", OPS, ["awk", "sort", "family", "reward-only"], seed, out)
