"""bench/tb2_bench.py's reading of a failed oracle run: tests that hide pytest's output in a log file and ask
`uvx --python X.Y` for a Python the image lacks count as needing the internet (uv would download CPython);
a failed build or a pytest summary in the evidence is read by the other rules."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import tb2_bench  # noqa: E402

TEST_SH = "#!/bin/bash\nuvx --python 3.12 --with pytest==8.3.3 \\\n  pytest /tests/test_outputs.py > /logs/verifier/out.txt 2>&1\n"


@pytest.fixture
def task(tmp_path: Path) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test.sh").write_text(TEST_SH)
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment/Dockerfile").write_text("FROM gcc:13.3.0-bookworm\nRUN apt-get install -y python3\n")
    return tmp_path


@pytest.mark.parametrize("evidence, note, cause", [
    ("", "gcc:13.3.0-bookworm: furlong's gcc-12 stand-in (gcc 12.2.0, ...)", "tests need internet"),
    ("mv: cannot move '/tests' to '/tmp/tests.hidden': Device or resource busy\n", "", "tests need internet"),
    ("", "python:3.12-slim: furlong's python stand-in (Python 3.12.1, ...)", "other"),  # it has the Python asked
    ("FAILED test_outputs.py::test_x\n1 failed, 3 passed in 0.2s\n", "", "other"),  # pytest ran: its own result
    ("image unavailable: SandboxError: image build failed: Dockerfile:2: RUN exited 100: E: no such package", "",
     "other"),  # a failed build is never the tests' fault
])
def test_a_hidden_test_log_asking_uv_for_a_python_the_image_lacks_needs_the_internet(task, evidence, note, cause):
    assert tb2_bench.cause_of(task, evidence, False, note) == cause


@pytest.mark.parametrize("result", ["tb2.json", "tb2_rest.json", "tb2_harbor.json", "tb2_packages.json"])
def test_the_docs_headline_is_the_jsons(result: str):
    """docs/tb2.md's bold line for each committed run is what that run's rows count, and names its commit."""
    path = Path(__file__).resolve().parent.parent / "bench/results" / result
    if not path.is_file():
        pytest.fail(f"{path} is cited by docs/tb2.md and must be committed")
    data = json.loads(path.read_text())
    rows = data["rows"]
    built = sum(r["built"] for r in rows)
    oracle = sum(bool(r["oracle_pass"]) for r in rows)
    noop = sum(bool(r["noop_pass"]) for r in rows)
    line = (f"**{len(rows)} tasks: {built} built, {oracle} passed with their oracle, "
            f"{noop} passed with the no-op agent.**")
    doc = (Path(__file__).resolve().parent.parent / "docs/tb2.md").read_text()
    heads = [m.start() for m in re.finditer(r"^\*\*\d+ tasks: ", doc, re.MULTILINE)]
    # the text between the previous headline and this one introduces the run: its JSON and its commit
    intros = [doc[max(heads[k - 1] if k else 0, i - 2000):i] for k, i in enumerate(heads) if doc.startswith(line, i)]
    assert any(f"bench/results/{result}" in t and data["provenance"]["commit"][:7] in t for t in intros), (line, intros)


def test_the_docs_table_gives_each_runs_oracle():
    """docs/tb2.md's sample table: the offline run's built/oracle/noop/cause, the reruns' oracle, per task."""
    root = Path(__file__).resolve().parent.parent
    runs = [{r["task"]: r for r in json.loads((root / "bench/results" / name).read_text())["rows"]}
            for name in ("tb2.json", "tb2_harbor.json", "tb2_packages.json")]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in (root / "docs/tb2.md").read_text().splitlines()
            if line.startswith("| ") and line.count("|") == 9 and not line.startswith("| task ")]
    assert sorted(r[0] for r in rows) == sorted(runs[0])

    def said(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "no")
    for task, _, built, oracle, noop, cause, harbor, packages in rows:
        offline = runs[0][task]
        assert (built, oracle, noop, cause) == (said(offline["built"]), said(offline["oracle_pass"]),
                                                said(offline["noop_pass"]), offline["cause"] or ""), task
        assert (harbor, packages) == (said(runs[1][task]["oracle_pass"]), said(runs[2][task]["oracle_pass"])), task
