"""SWE-bench-style instances imported into Harbor tasks (`furlong tasks import-swe`, docs/swe.md): on the
tiny repository of tests/swe_support.py, the gold patch resolves every instance, doing nothing none, and a
patch that fixes FAIL_TO_PASS but breaks PASS_TO_PASS is not resolved; the grader agrees with the real
`swebench` package on every log; bad instances are errors naming the line and field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from rich.console import Console
from swebench.harness.grading import get_eval_report
from swebench.types import TestSpec as SweTestSpec  # not `Test*`: pytest would collect it
from swebench.utils import get_modified_files

import swe_support
from conftest import run
from furlong.cli import main
from furlong.eval.agents import AgentRun, NoopAgent, OracleAgent
from furlong.eval.run import run_eval
from furlong.tasks import swe_grading
from furlong.tasks.loader import load_task
from furlong.tasks.swe import SweImportError, import_instances, patch_files

QUIET = Console(file=open(os.devnull, "w"))


class ScriptAgent:
    """Runs one bash script in /testbed, as an agent's commands would; its output is the record's."""

    def __init__(self, name: str, script: str):
        self.name, self.script = name, script

    async def run(self, task, tools, timeout_s: float) -> AgentRun:
        res = await tools.sandbox.exec(self.script, timeout_s=60, cwd="/testbed")
        return AgentRun(commands=1, last_exit_code=res.exit_code, last_output=res.stdout + res.stderr)


def _apply(patch: str) -> str:
    return f"git apply -v - <<'EOF_PATCH'\n{patch}EOF_PATCH\n"


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[swe_support.Fixture, Path]:
    root = tmp_path_factory.mktemp("swe")
    fixture = swe_support.build(root)
    assert main(["tasks", "import-swe", str(fixture.instances), "--repo-dir", str(fixture.repo),
                 "--out", str(root / "tasks")]) == 0
    return fixture, root / "tasks"


def test_oracle_resolves_every_instance_and_noop_none(imported, backend, store):
    fixture, out = imported
    tasks = [load_task(out / i) for i in fixture.ids]
    oracle = run(run_eval(tasks, OracleAgent(), backend, store, 2, None, QUIET))
    assert {r.task: (r.status, r.rewards) for r in oracle} == {
        i: ("ok", {"reward": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0}) for i in fixture.ids}
    noop = run(run_eval(tasks, NoopAgent(), backend, store, 2, None, QUIET))
    assert {r.task: (r.status, r.rewards) for r in noop} == {
        i: ("ok", {"reward": 0.0, "fail_to_pass": 0.0, "pass_to_pass": 1.0}) for i in fixture.ids}
    report = json.loads(noop[1].verifier_output)["textkit__textkit-2"]  # the verifier prints report.json's entry
    assert report["tests"] == {"tests/test_median.py::test_median[odd]": "PASSED",
                               "tests/test_median.py::test_median[even]": "FAILED"}


def test_agent_sees_the_base_commit_only_and_the_graders_verdicts(imported, backend, store):
    fixture, out = imported
    # what an agent can find: one commit, the bug, no test patch, no lists, an empty /tests
    look = ScriptAgent("look", "git log --oneline | wc -l; grep -c 'len(text.split(\" \"))' textkit/words.py; "
                               "ls tests; grep -rl extra_whitespace /testbed /tests /logs /solution 2>/dev/null | wc -l; "
                               "ls -A /tests 2>/dev/null | wc -l")
    [seen] = run(run_eval([load_task(out / fixture.ids[0])], look, backend, store, 1, None, QUIET))
    assert seen.agent_output.split() == ["1", "1", "test_slug.py", "test_stats.py", "test_words.py", "0", "0"], \
        seen.agent_output
    # a fix of FAIL_TO_PASS that breaks a PASS_TO_PASS test is not resolved
    wrong = ScriptAgent("wrong", _apply(swe_support.WRONG_PATCH_3))
    [res] = run(run_eval([load_task(out / fixture.ids[2])], wrong, backend, store, 1, None, QUIET))
    assert res.rewards == {"reward": 0.0, "fail_to_pass": 1.0, "pass_to_pass": 0.5}
    status = json.loads(res.verifier_output)["textkit__textkit-3"]["tests_status"]["PASS_TO_PASS"]
    assert status == {"success": ["tests/test_slug.py::test_slugify_basic"],
                      "failure": ["tests/test_slug.py::test_slugify_keeps_digits"]}
    # the test files are reset to base_commit first: the gold patch plus a test file gutted still resolves
    gold = json.loads(fixture.instances.read_text().splitlines()[0])["patch"]
    gutted = ScriptAgent("gutted", _apply(gold) + "echo 'def test_title_case(): pass' > tests/test_words.py\n")
    [res] = run(run_eval([load_task(out / fixture.ids[0])], gutted, backend, store, 1, None, QUIET))
    assert res.rewards == {"reward": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0}


def _pytest_log(repo: Path, commit: str, patches: list[str], tests: list[str]) -> str:
    """The log test.sh writes: real pytest output between swebench's markers, the exit code after."""
    work = Path(tempfile.mkdtemp(dir=repo.parent, prefix="work-"))
    swe_support._git(repo, "worktree", "add", "-q", "--detach", str(work), commit)
    for patch in patches:
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=work, check=True)
    res = subprocess.run([sys.executable, "-m", "pytest", "--no-header", "-rA", "--tb=no", "-p", "no:cacheprovider",
                          *tests], cwd=work, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # as in the image: no plugins
    return (f"{swe_grading.START_TEST_OUTPUT}\n{res.stdout}{res.stderr}{swe_grading.END_TEST_OUTPUT}\n"
            f"{swe_grading.TEST_EXIT_CODE}: {res.returncode}\n")


def _logs(fixture: swe_support.Fixture) -> list[tuple[str, dict]]:
    """(log, instance) pairs: each instance at base, gold and (instance 3) the wrong patch, then variants
    that exercise the rest of swebench's rules."""
    insts = [json.loads(line) for line in fixture.instances.read_text().splitlines()]
    logs = []
    for inst in insts:
        tests = [p for p in patch_files(inst["test_patch"]).directives]
        for fix in ([], [inst["patch"]]):
            logs.append((_pytest_log(fixture.repo, inst["base_commit"], [inst["test_patch"], *fix], tests), inst))
    third = insts[2]
    logs.append((_pytest_log(fixture.repo, third["base_commit"], [third["test_patch"], swe_support.WRONG_PATCH_3],
                             ["tests/test_slug.py"]), third))
    gold3 = logs[5][0]
    skipped = gold3.replace("PASSED tests/test_slug.py::test_slugify_basic", "SKIPPED tests/test_slug.py::test_slugify_basic")
    variants = [
        gold3.replace(swe_grading.START_TEST_OUTPUT, swe_grading.APPLY_PATCH_FAIL),  # a failure marker
        gold3.split(swe_grading.END_TEST_OUTPUT)[0],  # no end marker
        gold3.replace(f"{swe_grading.TEST_EXIT_CODE}: 0", f"{swe_grading.TEST_EXIT_CODE}: 1"),  # an exit code contradicting an all-PASSED log
        skipped,  # a skipped PASS_TO_PASS test is kept
        gold3.replace("PASSED tests/test_slug.py::test_slugify_punctuation",
                      "SKIPPED tests/test_slug.py::test_slugify_punctuation"),  # a skipped FAIL_TO_PASS is no fix
        gold3.replace("PASSED tests/test_slug.py::test_slugify_punctuation",
                      "XFAIL tests/test_slug.py::test_slugify_punctuation - reason"),
        gold3.replace("PASSED tests/test_slug.py::test_slugify_keeps_digits",
                      "ERROR tests/test_slug.py::test_slugify_keeps_digits - boom"),
        f"{swe_grading.START_TEST_OUTPUT}\n{swe_grading.END_TEST_OUTPUT}\n",  # nothing ran
    ]
    logs += [(v, third) for v in variants]
    cut = dict(insts[1], FAIL_TO_PASS=json.dumps(["tests/test_median.py::test_median[ev"]))  # a truncated id
    logs += [(logs[2][0], cut), (logs[3][0], cut)]
    return logs


def test_grading_matches_the_swebench_package(imported, tmp_path: Path):
    fixture, _ = imported
    verdicts = []
    for n, (log, inst) in enumerate(_logs(fixture)):
        f2p, p2p = (json.loads(x) if isinstance(x, str) else x for x in (inst["FAIL_TO_PASS"], inst["PASS_TO_PASS"]))
        (tmp_path / f"{n}.log").write_text(log)
        spec = SweTestSpec(instance_id=inst["instance_id"], image="", eval_script_list=[], repo=inst["repo"],
                        version=inst["version"], FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, log_parser="parse_log_pytest",
                        eval_type="pass_and_fail")
        theirs = get_eval_report(spec, {"instance_id": inst["instance_id"], "model_patch": "x"},
                                 str(tmp_path / f"{n}.log"), include_tests_status=True)[inst["instance_id"]]
        ours = swe_grading.grade(log, inst["instance_id"], f2p, p2p)
        keys = ("resolved", "patch_successfully_applied", "tests_status")
        assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}, (n, log)
        verdicts.append(ours["resolved"])
    # base, gold for each instance; the wrong patch; then the variants; the truncated id at base, at gold
    assert verdicts == [False, True] * 3 + [False] + [False, False, False, True, False, True, False, False] + [False, True]


def test_patch_files_reads_patches_as_swebench_does(imported):
    fixture, _ = imported
    tricky = ("diff --git a/pkg/data.json b/pkg/data.json\n--- a/pkg/data.json\n+++ b/pkg/data.json\n@@ -1 +1 @@\n"
              "-{}\n+[]\ndiff --git a/tests/test_old.py b/tests/test_old.py\ndeleted file mode 100644\n"
              "--- a/tests/test_old.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n--- not a header: a removed line\n-x = 1\n")
    for patch in [json.loads(line)["test_patch"] for line in fixture.instances.read_text().splitlines()] + [tricky]:
        assert list(patch_files(patch).modified) == get_modified_files(patch)
    assert patch_files(tricky).directives == ("tests/test_old.py",)  # data files are not run
    assert patch_files(json.loads(fixture.instances.read_text().splitlines()[1])["test_patch"]).added == (
        "tests/test_median.py",)


def _bad(tmp_path: Path, fixture: swe_support.Fixture, line: int, **change) -> str:
    lines = fixture.instances.read_text().splitlines()
    inst = json.loads(lines[line - 1])
    for key, value in change.items():
        if value is None:
            del inst[key]
        else:
            inst[key] = value
    lines[line - 1] = json.dumps(inst)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(SweImportError) as err:
        import_instances(bad, fixture.repo, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "nothing is half written"
    return str(err.value)


def test_bad_instances_name_the_line_and_field(imported, tmp_path: Path, capsys):
    fixture, _ = imported
    cases = [
        (2, {"FAIL_TO_PASS": 42}, "line 2: field 'FAIL_TO_PASS': Input should be a valid list"),
        (2, {"FAIL_TO_PASS": "[not json"}, "line 2: field 'FAIL_TO_PASS': Value error, expected a list of test ids"),
        (3, {"FAIL_TO_PASS": "[]"}, "line 3: field 'FAIL_TO_PASS': List should have at least 1 item"),
        (1, {"base_commit": None}, "line 1: field 'base_commit': Field required"),
        (3, {"base_commit": "0" * 40}, f"line 3: field 'base_commit': {'0' * 40} is not a commit of"),
        (1, {"instance_id": "../escape"}, "line 1: field 'instance_id': String should match pattern"),
        (2, {"instance_id": "textkit__textkit-1"}, "line 2: field 'instance_id': 'textkit__textkit-1' is also on line 1"),
        (3, {"patch": swe_support.WRONG_PATCH_3.replace("textkit/slug.py", "textkit/words.py")},
         "line 3: field 'patch': does not apply at base_commit"),
    ]
    for line, change, expected in cases:
        assert expected in _bad(tmp_path, fixture, line, **change), (line, change)
    # --repo-dir may hold one clone per repository, as OWNER/NAME, a bare one too
    repos = tmp_path / "repos"
    with pytest.raises(SweImportError, match="line 1: field 'repo': no git repository for 'textkit/textkit'"):
        import_instances(fixture.instances, repos, tmp_path / "by-name")
    swe_support._git(fixture.repo, "clone", "-q", "--bare", str(fixture.repo), str(repos / "textkit" / "textkit"))
    by_name = import_instances(fixture.instances, repos, tmp_path / "by-name")
    assert [p.name for p in by_name] == list(fixture.ids)
    assert (by_name[0] / "environment" / "testbed" / "textkit" / "words.py").read_text() == \
        swe_support.INITIAL["textkit/words.py"]
    (tmp_path / "not.jsonl").write_text('{"instance_id": "a"}\n[1, 2]\n')
    assert main(["tasks", "import-swe", str(tmp_path / "not.jsonl"), "--repo-dir", str(fixture.repo),
                 "--out", str(tmp_path / "o")]) == 2
    assert "not.jsonl: line 1: field 'repo': Field required" in capsys.readouterr().err.replace("\n", "")
