"""Instance generators shared by a demonstrated family and its reward-only twin (number-stats and
number-words; transform-text and text-words). The twins ask for the same commands in other words: each
family's generate.py holds only its wording (OPS: op -> (instruction templates, solution command)) and
calls one of these, so the data, the checks and the tests of the two can never drift apart.

Runs inside the generator sandbox (furlong.tasks.genrun): the standard library and furlong.tasks.kit only."""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import reward_test, write_task

Ops = dict[str, tuple[list[str], str]]  # op: (instruction templates, solution command)

NUMBER_OPS = ("count", "max", "min", "sum")
TEXT_OPS = ("lower", "reverse", "sort", "upper")
TEXT_WORDS = "Amber anchor Apple arrow Badge basket Beacon berry Bottle breeze Bridge cabin Candle castle".split()

NUMBER_TEST = reward_test(
    "/app/answer.txt must hold the expected number (surrounding whitespace ignored)",
    '[ -f /app/answer.txt ] && [ "$(tr -d \' \\n\' < /app/answer.txt)" = "$(tr -d \' \\n\' < /tests/expected.txt)" ]')
TEXT_TEST = reward_test(
    "/app/output.txt must equal the expected text (a missing final newline is forgiven)",
    '[ -f /app/output.txt ] && [ "$(cat /app/output.txt)" = "$(cat /tests/expected.txt)" ]')


def _check(family: str, ops: Ops, names: tuple[str, ...]) -> None:
    if tuple(sorted(ops)) != names:
        raise ValueError(f"{family}: OPS must name exactly {', '.join(names)}; got {', '.join(sorted(ops))}")


def number_instance(family: str, ops: Ops, tags: list[str], seed: int, out: Path) -> None:
    """One statistic (sum, max, min or count) of 5-12 numbers, every statistic a different answer."""
    _check(family, ops, NUMBER_OPS)
    rng = random.Random(f"{family}:{seed}")
    op = rng.choice(NUMBER_OPS)
    while True:
        numbers = [rng.randint(1, 999) for _ in range(rng.randint(5, 12))]
        answers = {"sum": sum(numbers), "max": max(numbers), "min": min(numbers), "count": len(numbers)}
        if len(set(answers.values())) == len(answers):  # a wrong statistic must never pass
            break
    templates, command = ops[op]
    write_task(out, instruction=rng.choice(templates), category="pipelines", difficulty="easy", tags=tags,
               test_sh=NUMBER_TEST, solve_sh=command, env_files={"numbers.txt": "".join(f"{x}\n" for x in numbers)},
               test_files={"expected.txt": f"{answers[op]}\n"})


def transform(op: str, lines: list[str]) -> list[str]:
    return {"upper": [ln.upper() for ln in lines], "lower": [ln.lower() for ln in lines],
            "sort": sorted(lines, key=lambda s: s.encode()), "reverse": lines[::-1]}[op]


def text_instance(family: str, ops: Ops, tags: list[str], seed: int, out: Path) -> None:
    """One transformation (upper, lower, sort, reverse) of 4-8 lines; each, and doing nothing, differ."""
    _check(family, ops, TEXT_OPS)
    rng = random.Random(f"{family}:{seed}")
    op = rng.choice(TEXT_OPS)
    while True:
        lines = [" ".join(rng.choice(TEXT_WORDS) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(4, 8))]
        results = {o: tuple(transform(o, lines)) for o in TEXT_OPS}
        if len(set(results.values())) == len(results) and tuple(lines) not in results.values():
            break  # every transformation, and doing nothing, give different files
    templates, command = ops[op]
    write_task(out, instruction=rng.choice(templates), category="files-text", difficulty="easy", tags=tags,
               test_sh=TEXT_TEST, solve_sh=command, env_files={"input.txt": "\n".join(lines) + "\n"},
               test_files={"expected.txt": "\n".join(results[op]) + "\n"})
