"""Helpers shared by the bundled task families: the word list and a Harbor task writer.

A family's `generate(seed, out)` stays a short, readable description of its instances; how a
Harbor task directory is laid out lives here once.
"""

from __future__ import annotations

import json
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
    return (f"#!/bin/bash\n# {comment}\nmkdir -p /logs/verifier\necho 0 > /logs/verifier/reward.txt\n"
            f"if {condition}; then\n  echo 1 > /logs/verifier/reward.txt\nfi\n")


def python_test(comment: str) -> str:
    """A test.sh that writes reward 1 if /tests/check.py exits 0, else 0 (always writes one)."""
    return reward_test(comment, "python3 /tests/check.py")


def write_task(out: Path, *, instruction: str, category: str, difficulty: str, tags: list[str],
               test_sh: str, solve_sh: str, env_files: dict[str, str] | None = None,
               test_files: dict[str, str] | None = None, agent_timeout: float = 60.0) -> None:
    """Writes a Harbor task; env_files are copied into /app by the Dockerfile."""
    env_files = env_files or {}
    dockerfile = "FROM debian:bookworm-slim\nWORKDIR /app\n"
    dockerfile += "".join(f"COPY {name} /app/{name}\n" for name in env_files)
    files = {
        "instruction.md": instruction.strip() + "\n",
        "task.toml": TASK_TOML.format(category=category, difficulty=difficulty, tags=json.dumps(tags),
                                      agent_timeout=agent_timeout),
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
