"""Task family transform-text: write /app/input.txt upper-cased, lower-cased, sorted or with its lines
reversed to /app/output.txt. Fixed paths; the transformation asked for decides the command.
Deterministic per seed."""

from __future__ import annotations

from pathlib import Path

from furlong.tasks.kit import text_instance

OPS = {  # name: (instruction templates, solution command)
    "upper": (["Write /app/input.txt in upper case to /app/output.txt.",
               "Convert the text of /app/input.txt to upper case and save it as /app/output.txt."],
              "tr a-z A-Z < /app/input.txt > /app/output.txt"),
    "lower": (["Write /app/input.txt in lower case to /app/output.txt.",
               "Convert the text of /app/input.txt to lower case and save it as /app/output.txt."],
              "tr A-Z a-z < /app/input.txt > /app/output.txt"),
    "sort": (["Write the lines of /app/input.txt sorted alphabetically to /app/output.txt.",
              "Sort the lines of /app/input.txt and save them as /app/output.txt."],
             "sort /app/input.txt > /app/output.txt"),
    "reverse": (["Write the lines of /app/input.txt in reverse order to /app/output.txt.",
                 "Reverse the order of the lines of /app/input.txt and save them as /app/output.txt."],
                "tac /app/input.txt > /app/output.txt"),
}


def generate(seed: int, out: Path) -> None:
    text_instance("transform-text", OPS, ["tr", "sort", "tac", "family"], seed, out)
