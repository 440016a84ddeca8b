"""Task family text-words (reward-only by default): transform-text's four transformations, asked in other
words. The default SFT never shows this family's demonstrations: the policy knows the commands from
transform-text but must learn from the verifier's reward which of these words asks for which. Every
instance has its own text, so no answer carries over, and one fixed command passes about a quarter.
Deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import reward_test, write_task

WORDS = "Amber anchor Apple arrow Badge basket Beacon berry Bottle breeze Bridge cabin Candle castle".split()

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

TEST_SH = reward_test("/app/output.txt must equal the expected text (a missing final newline is forgiven)",
                      '[ -f /app/output.txt ] && [ "$(cat /app/output.txt)" = "$(cat /tests/expected.txt)" ]')


def transform(op: str, lines: list[str]) -> list[str]:
    return {"upper": [ln.upper() for ln in lines], "lower": [ln.lower() for ln in lines],
            "sort": sorted(lines, key=lambda s: s.encode()), "reverse": lines[::-1]}[op]


def generate(seed: int, out: Path) -> None:
    rng = random.Random(f"text-words:{seed}")
    op = rng.choice(sorted(OPS))
    while True:
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(4, 8))]
        results = {o: tuple(transform(o, lines)) for o in OPS}
        if len(set(results.values())) == len(results) and tuple(lines) not in results.values():
            break  # every transformation, and doing nothing, give different files
    templates, command = OPS[op]
    write_task(out, instruction=rng.choice(templates), category="files-text", difficulty="easy",
               tags=["tr", "sort", "tac", "family", "reward-only"], test_sh=TEST_SH, solve_sh=command,
               env_files={"input.txt": "\n".join(lines) + "\n"},
               test_files={"expected.txt": "\n".join(results[op]) + "\n"})
