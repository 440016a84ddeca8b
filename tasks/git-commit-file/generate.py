"""Task family git-commit-file: Initialise a git repository, add a file with given content and commit it with a given message.

Every instance is a deterministic function of its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task


def generate(seed: int, out: Path) -> None:
    rng = random.Random(seed)
    repo = f"/app/{rng.choice(WORDS)}-repo"
    name = f"{rng.choice(WORDS)}.txt"
    word = rng.choice(WORDS)
    msg = f"{rng.choice(['Add', 'Create', 'Start', 'Record'])} {rng.choice(WORDS)} {rng.choice(['notes', 'file', 'list', 'data'])}"
    g = f"git -C {repo}"
    write_task(
        out,
        instruction=(f"Create a git repository in `{repo}`. In it, commit a file `{name}` containing the word "
                     f"`{word}`, with the commit message `{msg}`."),
        category="git", difficulty="medium", tags=["git", "commit"],
        test_sh=reward_test(f"{repo} must have one commit '{msg}' with {name} containing {word}.",
                            f'[ "$({g} rev-list --count HEAD)" = 1 ] && [ "$({g} log -1 --format=%s)" = "{msg}" ] '
                            f'&& [ "$({g} show HEAD:{name})" = "{word}" ]'),
        solve_sh=(f"mkdir -p {repo} && cd {repo} && git init -q && echo {word} > {name} && git add {name} && "
                  f'git -c user.name=agent -c user.email=agent@example.com commit -q -m "{msg}"'),
        agent_timeout=120.0,
    )
