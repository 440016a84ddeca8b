"""Task family count-in-file: count the lines, words or characters of /app/data.txt, or copy its first or
last N lines. Fixed paths, so the agent's work is to pick the right command for the words of the
instruction; the data (and so every answer) differs per seed. Deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import reward_test, write_task

WORDS = "amber anchor apple arrow badge basket beacon berry bottle breeze bridge cabin candle castle cedar".split()

OPS = {  # name: (instruction templates, solution command)
    "lines": (["Count the lines in /app/data.txt and write the number to /app/answer.txt.",
               "How many lines does /app/data.txt have? Write the number to /app/answer.txt."],
              "wc -l < /app/data.txt > /app/answer.txt"),
    "words": (["Count the words in /app/data.txt and write the number to /app/answer.txt.",
               "How many words does /app/data.txt have? Write the number to /app/answer.txt."],
              "wc -w < /app/data.txt > /app/answer.txt"),
    "chars": (["Count the characters in /app/data.txt and write the number to /app/answer.txt.",
               "How many characters does /app/data.txt have? Write the number to /app/answer.txt."],
              "wc -c < /app/data.txt > /app/answer.txt"),
    "head": (["Write the first {n} lines of /app/data.txt to /app/answer.txt."], "head -n {n} /app/data.txt > /app/answer.txt"),
    "tail": (["Write the last {n} lines of /app/data.txt to /app/answer.txt."], "tail -n {n} /app/data.txt > /app/answer.txt"),
}

TEST_SH = reward_test("/app/answer.txt must hold the expected answer (compared ignoring surrounding whitespace)",
                      '[ -f /app/answer.txt ] && python3 -c "import sys; sys.exit(open(\'/app/answer.txt\').read().strip() != open(\'/tests/expected.txt\').read().strip())"')


def answer(op: str, text: str, n: int) -> str:
    lines = text.splitlines()
    return {"lines": str(len(lines)), "words": str(len(text.split())), "chars": str(len(text)),
            "head": "\n".join(lines[:n]), "tail": "\n".join(lines[-n:])}[op]


def generate(seed: int, out: Path) -> None:
    rng = random.Random(f"count-in-file:{seed}")
    op, n = rng.choice(sorted(OPS)), rng.randint(2, 5)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(7, 15))]
    text = "\n".join(lines) + "\n"
    answers = {o: answer(o, text, n) for o in OPS}
    assert len(set(answers.values())) == len(answers), "every operation must give a different answer"
    templates, command = OPS[op]
    write_task(out, instruction=rng.choice(templates).format(n=n), category="pipelines", difficulty="easy",
               tags=["wc", "head", "tail", "family"], test_sh=TEST_SH, solve_sh=command.format(n=n),
               env_files={"data.txt": text}, test_files={"expected.txt": answers[op] + "\n"})
