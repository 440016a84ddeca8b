"""Helpers shared by the bundled task families: the word list, a Harbor task writer, and the instance
generators a demonstrated family shares with its reward-only twin.

A family's `generate(seed, out)` stays a short, readable description of its instances; how a
Harbor task directory is laid out lives here once.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Lowercase a-z words; none is a substring of another, so `grep WORD` and `sed s/WORD/...` are exact.
WORDS = """
amber anchor apple arrow autumn badge basket beacon berry blanket blossom bottle breeze bridge bucket
butter cabin cactus candle canyon carpet castle cedar cherry circle cliff cloud clover cobalt comet copper
coral cotton crystal dagger desert dolphin dragon eagle ember falcon feather fiddle forest fossil fountain
galaxy garden garlic glacier goblet granite harbor hazel helmet honey island ivory jacket jasmine jelly
jungle kettle kitten ladder lantern lemon lizard magnet mango marble meadow melon mirror monkey mountain
needle nickel noodle ocean olive orbit orchid otter oyster paddle palace parrot pebble pepper pillow planet
pocket prairie puzzle quartz quiver rabbit radish raven ribbon rocket saddle salmon shadow silver spider
spoon squirrel stable summer sunset thunder ticket tiger timber tomato tunnel turtle velvet violet walnut
whistle willow window winter wizard yellow zebra
""".split()

TASK_TOML = """version = "1.0"

[metadata]
category = "{category}"
difficulty = "{difficulty}"
tags = {tags}

[agent]
timeout_sec = {agent_timeout}

[verifier]
timeout_sec = 30.0

[environment]
cpus = 1
memory_mb = 512
"""


def reward_test(comment: str, condition: str) -> str:
    """A test.sh that writes reward 1 if the shell `condition` holds, else 0 (always writes one)."""
    return (
        f"#!/bin/bash\n# {comment}\nmkdir -p /logs/verifier\necho 0 > /logs/verifier/reward.txt\n"
        f"if {condition}; then\n  echo 1 > /logs/verifier/reward.txt\nfi\n"
    )


def python_test(comment: str) -> str:
    """A test.sh that writes reward 1 if /tests/check.py exits 0, else 0 (always writes one)."""
    return reward_test(comment, "python3 /tests/check.py")


def write_task(
    out: Path,
    *,
    instruction: str,
    category: str,
    difficulty: str,
    tags: list[str],
    test_sh: str,
    solve_sh: str,
    env_files: dict[str, str] | None = None,
    test_files: dict[str, str] | None = None,
    agent_timeout: float = 60.0,
) -> None:
    """Writes a Harbor task; env_files are copied into /app by the Dockerfile."""
    env_files = env_files or {}
    dockerfile = "FROM debian:bookworm-slim\nWORKDIR /app\n"
    dockerfile += "".join(f"COPY {name} /app/{name}\n" for name in env_files)
    files = {
        "instruction.md": instruction.strip() + "\n",
        "task.toml": TASK_TOML.format(
            category=category, difficulty=difficulty, tags=json.dumps(tags), agent_timeout=agent_timeout
        ),
        "environment/Dockerfile": dockerfile,
        "tests/test.sh": test_sh,
        "solution/solve.sh": "#!/bin/bash\n" + solve_sh.strip() + "\n",
    }
    files.update({f"environment/{k}": v for k, v in env_files.items()})
    files.update({f"tests/{k}": v for k, v in (test_files or {}).items()})
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)


# Instance generators shared by a demonstrated family and its reward-only twin (number-stats and
# number-words; transform-text and text-words). The twins ask for the same commands in other words: each
# family's generate.py holds only its wording (OPS: op -> (instruction templates, solution command)) and
# calls one of these, so the data, the checks and the tests of the two can never drift apart.

Ops = dict[str, tuple[list[str], str]]  # op: (instruction templates, solution command)

NUMBER_OPS = ("count", "max", "min", "sum")
TEXT_OPS = ("lower", "reverse", "sort", "upper")
TEXT_WORDS = "Amber anchor Apple arrow Badge basket Beacon berry Bottle breeze Bridge cabin Candle castle".split()

NUMBER_TEST = reward_test(
    "/app/answer.txt must hold the expected number (surrounding whitespace ignored)",
    "[ -f /app/answer.txt ] && [ \"$(tr -d ' \\n' < /app/answer.txt)\" = \"$(tr -d ' \\n' < /tests/expected.txt)\" ]",
)
TEXT_TEST = reward_test(
    "/app/output.txt must equal the expected text (a missing final newline is forgiven)",
    '[ -f /app/output.txt ] && [ "$(cat /app/output.txt)" = "$(cat /tests/expected.txt)" ]',
)


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
    write_task(
        out,
        instruction=rng.choice(templates),
        category="pipelines",
        difficulty="easy",
        tags=tags,
        test_sh=NUMBER_TEST,
        solve_sh=command,
        env_files={"numbers.txt": "".join(f"{x}\n" for x in numbers)},
        test_files={"expected.txt": f"{answers[op]}\n"},
    )


def transform(op: str, lines: list[str]) -> list[str]:
    return {
        "upper": [ln.upper() for ln in lines],
        "lower": [ln.lower() for ln in lines],
        "sort": sorted(lines, key=lambda s: s.encode()),
        "reverse": lines[::-1],
    }[op]


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
    write_task(
        out,
        instruction=rng.choice(templates),
        category="files-text",
        difficulty="easy",
        tags=tags,
        test_sh=TEXT_TEST,
        solve_sh=command,
        env_files={"input.txt": "\n".join(lines) + "\n"},
        test_files={"expected.txt": "\n".join(results[op]) + "\n"},
    )
