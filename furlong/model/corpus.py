"""A small, locally generated text corpus for training the tiny model's BPE tokenizer.

The tokenizer only needs to see the *kind* of text an agent reads and writes in a terminal (shell commands,
instructions, code, JSON tool calls, ChatML scaffolding) so that common pieces become single tokens. Nothing
is downloaded: text comes from seeded templates plus a fixed list of the running Python's stdlib sources.
"""

from __future__ import annotations

import itertools
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

WORDS = (
    "file files directory folder line lines word words number numbers text output input error result value "
    "list count sum total first last next all each every only new old empty hidden data log logs config "
    "report test tests script program function name path size date time user task answer string character "
    "create write read print show find search replace remove delete copy move rename sort unique reverse "
    "compute check make run compile install build save open close append extract split join merge compare"
).split()
# The common nouns the bundled task families draw file names and words from: in the corpus often
# enough that each is one token, both after a space and after a '/', so a tiny model copies a name
# from the instruction into its command as one token instead of three mismatched pieces.
TASK_NOUNS = (
    "amber anchor apple arrow autumn badge basket beacon berry blanket blossom bottle breeze bridge bucket "
    "butter cabin cactus candle canyon carpet castle cedar cherry circle cliff cloud clover cobalt comet copper "
    "coral cotton crystal dagger desert dolphin dragon eagle ember falcon feather fiddle forest fossil fountain "
    "galaxy garden garlic glacier goblet granite harbor hazel helmet honey island ivory jacket jasmine jelly "
    "jungle kettle kitten ladder lantern lemon lizard magnet mango marble meadow melon mirror monkey mountain "
    "needle nickel noodle ocean olive orbit orchid otter oyster paddle palace parrot pebble pepper pillow planet "
    "pocket prairie puzzle quartz quiver rabbit radish raven ribbon rocket saddle salmon shadow silver spider "
    "spoon squirrel stable summer sunset thunder ticket tiger timber tomato tunnel turtle velvet violet walnut "
    "whistle willow window winter wizard yellow zebra"
).split()
FILES = (
    "data.txt",
    "notes.md",
    "input.csv",
    "main.py",
    "main.c",
    "config.json",
    "app.log",
    "README.md",
    "out.txt",
    "numbers.txt",
    "words.txt",
    "report.json",
    "setup.sh",
    "Makefile",
    "server.log",
)
DIRS = ("/app", "/tmp", "/home/user", "/var/log", "/etc", "src", "build", "data", "tests", "/app/output")
SHELL = (
    "ls -la {d}",
    "cat {f}",
    "head -n {n} {f}",
    "tail -n {n} {f}",
    "wc -l {f}",
    "grep -n '{w}' {f}",
    "grep -rn '{w}' {d}",
    "sort {f} | uniq -c | sort -rn | head -n {n}",
    "find {d} -name '*.py' -type f",
    "sed -i 's/{w}/{w2}/g' {f}",
    "awk '{{print $1}}' {f} | sort -n",
    "mkdir -p {d}/{w}",
    "cp {f} {d}/",
    "mv {f} {d}/{f}.bak",
    "rm -f {f}",
    "echo '{w} {n}' > {f}",
    'echo "{w}" >> {f}',
    "python3 {f}",
    "python3 -c 'print(sum(range({n})))'",
    "gcc -O2 -o main main.c && ./main",
    "chmod +x setup.sh",
    "cd {d} && ls",
    "du -sh {d}",
    "tr 'a-z' 'A-Z' < {f}",
    "cut -d, -f{n} {f}",
    "diff {f} out.txt",
    "tar -czf backup.tar.gz {d}",
    "cat {f} | jq '.{w}'",
    "pwd",
    "whoami",
    "export PATH=$PATH:{d}",
)
INSTRUCTIONS = (
    "Create a file named {f} in {d} that contains the {w} of every line.",
    "Count the number of lines in {f} and write the {w} to out.txt.",
    "Find all files under {d} that contain the word '{w}' and list their paths.",
    "Write a Python script that reads {f} and prints the {n} most common words.",
    "Fix the bug in main.c so that it prints the sum of the first {n} numbers.",
    "Sort the numbers in {f} in ascending order and save them to out.txt.",
    "Replace every occurrence of '{w}' with '{w2}' in {f}.",
    "The tests in {d} are failing. Find out why and make them pass.",
    "Compute the average of the values in the second column of {f}.",
    "Extract all email addresses from {f} and write them, one per line, to out.txt.",
)


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        f=rng.choice(FILES), d=rng.choice(DIRS), w=rng.choice(WORDS), w2=rng.choice(WORDS), n=rng.randint(1, 1000)
    )


def _python_snippet(rng: random.Random) -> str:
    name, arg, w = rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)
    return (
        f"def {name}_{w}({arg}: list[int]) -> int:\n"
        f'    """Return the {w} of {arg}."""\n'
        f"    total = 0\n    for x in {arg}:\n        if x % {rng.randint(2, 9)} == 0:\n"
        f"            total += x\n    return total\n\n\n"
        f'if __name__ == "__main__":\n    print({name}_{w}([{", ".join(str(rng.randint(0, 99)) for _ in range(5))}]))'
        "\n"
    )


def _c_snippet(rng: random.Random) -> str:
    n, w = rng.randint(2, 100), rng.choice(WORDS)
    return (
        "#include <stdio.h>\n#include <stdlib.h>\n\n"
        f"int {w}(int n) {{\n    int s = 0;\n    for (int i = 0; i < n; i++) {{\n        s += i * {n};\n    }}\n"
        f'    return s;\n}}\n\nint main(void) {{\n    printf("%d\\n", {w}({n}));\n    return 0;\n}}\n'
    )


def _chat_episode(rng: random.Random) -> str:
    """A ChatML episode with Hermes-style tool calls, so the template's own scaffolding tokenizes compactly."""
    call = {"name": "bash", "arguments": {"command": _fill(rng.choice(SHELL), rng)}}
    output = "\n".join(_fill("{w} {n} {f}", rng) for _ in range(rng.randint(1, 4)))
    return (
        f"<|im_start|>system\nYou are a helpful assistant that solves tasks in a Linux terminal.<|im_end|>\n"
        f"<|im_start|>user\n{_fill(rng.choice(INSTRUCTIONS), rng)}<|im_end|>\n"
        f"<|im_start|>assistant\n<think>\nI should {rng.choice(WORDS)} the {rng.choice(WORDS)} first.\n</think>\n\n"
        f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe {rng.choice(WORDS)} is {rng.randint(0, 10**6)}.<|im_end|>\n"
    )


def _noun_lines(rng: random.Random) -> str:
    nouns = rng.sample(TASK_NOUNS, 6)
    return (
        "\n".join(
            f"echo {a} > /app/{b}{rng.randint(1, 99)}.txt; mkdir -p /app/{a}/{b}" for a, b in itertools.pairwise(nouns)
        )
        + "\n"
    )


GENERATORS = (
    _noun_lines,
    lambda rng: _fill(rng.choice(SHELL), rng) + "\n",
    lambda rng: _fill(rng.choice(INSTRUCTIONS), rng) + "\n",
    _python_snippet,
    _c_snippet,
    _chat_episode,
)


def stdlib_sources(max_bytes: int) -> Iterator[str]:
    """Python source from the running interpreter's stdlib, in sorted order (so the corpus is reproducible)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    used = 0
    for path in sorted(root.glob("*.py")):
        if used >= max_bytes:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or non-UTF-8 files carry nothing the tokenizer needs
        used += len(text)
        yield text


def generate_corpus(seed: int = 0, n_samples: int = 6000, stdlib_bytes: int = 1_500_000) -> Iterator[str]:
    """Yield training documents: seeded synthetic samples interleaved with stdlib source files."""
    rng = random.Random(seed)
    for i in range(n_samples):
        yield GENERATORS[i % len(GENERATORS)](rng)
    yield from stdlib_sources(stdlib_bytes)
