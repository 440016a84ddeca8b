"""A tiny Python repository with three SWE-bench-style instances (one bugfix each), built with git from
scratch: `build(DIR)` writes DIR/repo (the history) and DIR/instances.jsonl. `python tests/swe_support.py
DIR` builds it by hand, for `furlong tasks import-swe DIR/instances.jsonl --repo-dir DIR/repo --out TASKS`.

Each instance's base commit has the bug; its gold patch (`patch`) and test patch are the fix commit's diff
split as SWE-bench splits a pull request: source files, and tests/. Instance 1's test patch edits an
existing test file, instance 2's adds one with parametrized tests, instance 3's edits one whose other tests
a wrong fix breaks (WRONG_PATCH_3). The last commit (instance 3's fix) must never reach a task's image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PYPROJECT = """[project]
name = "textkit"
version = "0.1.0"

[tool.pytest.ini_options]
pythonpath = ["."]
"""

INITIAL = {
    "pyproject.toml": PYPROJECT,
    "textkit/__init__.py": '"""Small text and number helpers."""\n',
    "textkit/words.py": '''def count_words(text):
    """The number of words in text: runs of characters between whitespace."""
    return len(text.split(" "))


def title_case(text):
    return " ".join(w[:1].upper() + w[1:] for w in text.split(" "))
''',
    "textkit/stats.py": '''def mean(values):
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
''',
    "textkit/slug.py": '''import re


def slugify(text):
    """A URL slug: lowercase words joined by single hyphens."""
    return re.sub(r"\\s+", "-", text.strip().lower())
''',
    "tests/test_words.py": '''from textkit.words import count_words, title_case


def test_count_words_simple():
    assert count_words("one two three") == 3


def test_title_case():
    assert title_case("hello big world") == "Hello Big World"
''',
    "tests/test_stats.py": '''from textkit.stats import mean


def test_mean():
    assert mean([1, 2, 3, 6]) == 3
''',
    "tests/test_slug.py": '''from textkit.slug import slugify


def test_slugify_basic():
    assert slugify("Hello World") == "hello-world"


def test_slugify_keeps_digits():
    assert slugify("Top 10 Tips") == "top-10-tips"
''',
}

# (instance number, problem statement, the fix's source files, its test files, FAIL_TO_PASS, PASS_TO_PASS)
FIXES = [
    (1, ("count_words miscounts text with repeated spaces: count_words('a  b') returns 3, expected 2. "
         "Words are runs of characters between any whitespace."),
     {"textkit/words.py": INITIAL["textkit/words.py"].replace('len(text.split(" "))', "len(text.split())")},
     {"tests/test_words.py": INITIAL["tests/test_words.py"] + '''

def test_count_words_extra_whitespace():
    assert count_words("  a  b\\tc ") == 3
'''},
     ["tests/test_words.py::test_count_words_extra_whitespace"],
     ["tests/test_words.py::test_count_words_simple", "tests/test_words.py::test_title_case"]),
    (2, ("median() is wrong for lists of even length: median([1, 2, 3, 4]) returns 3, expected 2.5 "
         "(the mean of the two middle values)."),
     {"textkit/stats.py": INITIAL["textkit/stats.py"].replace(
         "    return ordered[len(ordered) // 2]\n",
         "    mid = len(ordered) // 2\n    if len(ordered) % 2:\n        return ordered[mid]\n"
         "    return (ordered[mid - 1] + ordered[mid]) / 2\n")},
     {"tests/test_median.py": '''import pytest

from textkit.stats import median


@pytest.mark.parametrize("values,expected", [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5)], ids=["odd", "even"])
def test_median(values, expected):
    assert median(values) == expected
'''},
     ["tests/test_median.py::test_median[even]"],
     ["tests/test_median.py::test_median[odd]"]),
    (3, ("slugify keeps punctuation: slugify('Hello, World!') returns 'hello,-world!', expected 'hello-world'. "
         "A slug should hold only lowercase letters, digits and single hyphens."),
     {"textkit/slug.py": INITIAL["textkit/slug.py"].replace(
         'return re.sub(r"\\s+", "-", text.strip().lower())',
         'return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")')},
     {"tests/test_slug.py": INITIAL["tests/test_slug.py"] + '''

def test_slugify_punctuation():
    assert slugify("Hello, World!") == "hello-world"
'''},
     ["tests/test_slug.py::test_slugify_punctuation"],
     ["tests/test_slug.py::test_slugify_basic", "tests/test_slug.py::test_slugify_keeps_digits"]),
]

# Fixes instance 3's FAIL_TO_PASS test but drops digits, failing its PASS_TO_PASS test_slugify_keeps_digits.
WRONG_PATCH_3 = """diff --git a/textkit/slug.py b/textkit/slug.py
--- a/textkit/slug.py
+++ b/textkit/slug.py
@@ -3,4 +3,4 @@ import re

 def slugify(text):
     \"\"\"A URL slug: lowercase words joined by single hyphens.\"\"\"
-    return re.sub(r"\\s+", "-", text.strip().lower())
+    return re.sub(r"[^a-z]+", "-", text.lower()).strip("-")
"""

GIT_ENV = {"GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@example.com", "GIT_COMMITTER_NAME": "dev",
           "GIT_COMMITTER_EMAIL": "dev@example.com", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


@dataclass(frozen=True)
class Fixture:
    repo: Path
    instances: Path
    ids: tuple[str, ...]
    commits: tuple[str, ...]  # the initial commit, then each fix's


def _git(repo: Path, *args: str) -> str:
    res = subprocess.run(["git", "-C", str(repo), *args], env={**os.environ, **GIT_ENV}, capture_output=True,
                         text=True, check=True)
    return res.stdout.strip()


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def build(root: Path) -> Fixture:
    repo = root / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    commits = [_commit(repo, INITIAL, "textkit: words, stats, slug")]
    lines = []
    for n, problem, source, tests, f2p, p2p in FIXES:
        base = commits[-1]
        commits.append(_commit(repo, {**source, **tests}, f"fix #{n}"))
        inst = {"instance_id": f"textkit__textkit-{n}", "repo": "textkit/textkit", "base_commit": base,
                "patch": _git(repo, "diff", base, commits[-1], "--", *source) + "\n",
                "test_patch": _git(repo, "diff", base, commits[-1], "--", *tests) + "\n",
                "problem_statement": problem, "hints_text": "", "created_at": f"2026-01-0{n}T00:00:00Z",
                "version": "0.1", "environment_setup_commit": commits[0],
                # SWE-bench's datasets hold the lists as JSON strings; instance 1 uses real lists
                "FAIL_TO_PASS": f2p if n == 1 else json.dumps(f2p),
                "PASS_TO_PASS": p2p if n == 1 else json.dumps(p2p)}
        lines.append(json.dumps(inst))
    instances = root / "instances.jsonl"
    instances.write_text("\n".join(lines) + "\n")
    return Fixture(repo, instances, tuple(f"textkit__textkit-{n}" for n, *_ in FIXES), tuple(commits))


if __name__ == "__main__":
    fixture = build(Path(sys.argv[1]))
    print(f"furlong tasks import-swe {fixture.instances} --repo-dir {fixture.repo} --out TASKS_DIR")
