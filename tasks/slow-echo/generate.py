"""Task family slow-echo: /app/work.sh sleeps 0.1-4 s (log-uniform by seed) and then prints a few lines of
words; the agent saves its output, its line or word count, or its first or last N lines to
/app/answer.txt, and the verifier sleeps 0.1-1 s before checking. The command to pick follows from the
instruction's words, as in count-in-file (so the tiny model can learn it from demos and RL can improve
it); what varies most is how long an episode's command and verifier take, so episodes finish at very
different times: the family asynchronous RL (train.rl.mode=async) has something to overlap with.
Deterministic per seed."""

from __future__ import annotations

import math
import random
from pathlib import Path

from furlong.tasks.kit import WORDS, reward_test, write_task

OPS = {  # name: (instruction templates, solution command)
    "output": (["Run /app/work.sh and write its output to /app/answer.txt.",
                "Write the output of /app/work.sh to /app/answer.txt."],
               "bash /app/work.sh > /app/answer.txt"),
    "lines": (["Run /app/work.sh and write the number of lines it prints to /app/answer.txt.",
               "How many lines does /app/work.sh print? Write the number to /app/answer.txt."],
              "bash /app/work.sh | wc -l > /app/answer.txt"),
    "words": (["Run /app/work.sh and write the number of words it prints to /app/answer.txt.",
               "How many words does /app/work.sh print? Write the number to /app/answer.txt."],
              "bash /app/work.sh | wc -w > /app/answer.txt"),
    "head": (["Run /app/work.sh and write the first {n} lines of its output to /app/answer.txt."],
             "bash /app/work.sh | head -n {n} > /app/answer.txt"),
    "tail": (["Run /app/work.sh and write the last {n} lines of its output to /app/answer.txt."],
             "bash /app/work.sh | tail -n {n} > /app/answer.txt"),
}


def answer(op: str, lines: list[str], n: int) -> str:
    return {"output": "\n".join(lines), "lines": str(len(lines)), "words": str(sum(len(ln.split()) for ln in lines)),
            "head": "\n".join(lines[:n]), "tail": "\n".join(lines[-n:])}[op]


def generate(seed: int, out: Path) -> None:
    rng = random.Random(f"slow-echo:{seed}")
    op, n = rng.choice(sorted(OPS)), rng.randint(2, 3)
    work_s = round(math.exp(rng.uniform(math.log(0.1), math.log(4.0))), 2)  # log-uniform: a long tail
    verify_s = round(rng.uniform(0.1, 1.0), 2)
    while True:
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(4, 7))]
        answers = {o: answer(o, lines, n) for o in OPS}
        if len(set(answers.values())) == len(answers):
            break  # every operation gives a different answer
    templates, command = OPS[op]
    same = "open('/app/answer.txt').read().strip() == open('/tests/expected.txt').read().strip()"
    test = reward_test(f"/app/answer.txt must hold the expected answer (the check itself takes {verify_s} s)",
                       f'sleep {verify_s} && [ -f /app/answer.txt ] && python3 -c "import sys; sys.exit(not ({same}))"')
    script = "#!/bin/bash\nsleep {}\ncat <<'END'\n{}\nEND\n".format(work_s, "\n".join(lines))
    write_task(out, instruction=rng.choice(templates).format(n=n), category="pipelines", difficulty="easy",
               tags=["sleep", "wc", "head", "tail", "family"], test_sh=test, solve_sh=command.format(n=n),
               env_files={"work.sh": script}, test_files={"expected.txt": answers[op] + "\n"})
