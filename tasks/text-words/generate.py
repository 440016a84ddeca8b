"""Task family text-words (reward-only by default): transform-text's four transformations, asked in other
words. The default SFT never shows this family's demonstrations: the policy knows the commands from
transform-text but must learn from the verifier's reward which of these words asks for which. Every
instance has its own text, so no answer carries over, and one fixed command passes about a quarter.
Deterministic per seed."""

from __future__ import annotations

from pathlib import Path

from furlong.tasks.kit import text_instance

OPS = {  # name: (instruction templates, solution command); transform-text says upper case, sorted, reverse...
    "upper": (["Write /app/input.txt in capitals to /app/output.txt.",
               "Convert the text of /app/input.txt to capital letters and save it as /app/output.txt."],
              "tr a-z A-Z < /app/input.txt > /app/output.txt"),
    "lower": (["Write /app/input.txt in small letters to /app/output.txt.",
               "Convert the text of /app/input.txt to small letters and save it as /app/output.txt."],
              "tr A-Z a-z < /app/input.txt > /app/output.txt"),
    "sort": (["Write the lines of /app/input.txt in dictionary order to /app/output.txt.",
              "Put the lines of /app/input.txt in A-to-Z order and save them as /app/output.txt."],
             "sort /app/input.txt > /app/output.txt"),
    "reverse": (["Write the lines of /app/input.txt last line first to /app/output.txt.",
                 "Flip the order of the lines of /app/input.txt upside down and save them as /app/output.txt."],
                "tac /app/input.txt > /app/output.txt"),
}


def generate(seed: int, out: Path) -> None:
    text_instance("text-words", OPS, ["tr", "sort", "tac", "family", "reward-only"], seed, out)
