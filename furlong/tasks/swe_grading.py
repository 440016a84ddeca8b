"""SWE-bench's grading of one instance's test log: "resolved" exactly as the `swebench` package (5.0.2)
decides it, in the standard library only.

The importer (furlong.tasks.swe) copies this file into every task's tests/, and the task's test.sh runs it
in the sandbox (`python3 grade.py LOG SPEC OUT_DIR`), so it imports nothing outside the standard library.
The steps mirror swebench.harness.grading: `get_logs_eval` (the log's status map, or none when the run is
unusable), `get_eval_tests_report` with the PASS_AND_FAIL rules (its test_passed, test_maintained and test_failed
are `passed`, `maintained` and `failed` here: a `test_` name would be collected by pytest), `get_resolution_status`, and
`parse_log_pytest` (swebench.harness.log_parsers.python). tests/test_swe_tasks.py checks every verdict
against the real package on the same logs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (FAILED, PASSED, SKIPPED, ERROR, XFAIL)  # swebench's TestStatus, in its order

# The eval script's markers (swebench.harness.constants)
APPLY_PATCH_FAIL = ">>>>> Patch Apply Failed"
RESET_FAILED = ">>>>> Reset Failed"
TESTS_ERROR = ">>>>> Tests Errored"
TESTS_TIMEOUT = ">>>>> Tests Timed Out"
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_EXIT_CODE = ">>>>> Test Exit Code"

# Evidence that a runner ran although it reported no test (swebench's SUITE_RAN, for its other runners)
SUITE_RAN = re.compile(
    r"Executed [1-9]\d* of \d+|TOTAL: [1-9]\d* (?:SUCCESS|FAILED)|[1-9]\d* passing|Tests:\s+[1-9]\d*"
    r"|Test Suites:\s+(?:\d+ \w+, )*[1-9]\d* total|^# tests [1-9]\d*|[1-9]\d* specs?, \d+ failures?|': ok$",
    re.MULTILINE,
)
TEST_EXIT_CODE_RE = re.compile(rf"{re.escape(TEST_EXIT_CODE)}:\s*(-?\d+)")
SKIP_SUMMARY_COUNT = re.compile(r"^\[\d+\]$")


def parse_log_pytest(log: str) -> dict[str, str]:
    """Test id -> status from pytest's `-rA` summary lines ("PASSED tests/test_a.py::test_x")."""
    status_map = {}
    for line in log.split("\n"):
        if not line.startswith(STATUSES):
            continue
        if line.startswith(FAILED):
            line = line.replace(" - ", " ")
        words = line.split()
        if len(words) <= 1:
            continue
        if words[0] == SKIPPED and SKIP_SUMMARY_COUNT.match(words[1]):
            continue  # "SKIPPED [2] file:line: reason": the [2] is a count, not a test
        status_map[words[1]] = words[0]
    return status_map


def status_map(log: str) -> dict[str, str] | None:
    """The tests' statuses, or None when the log does not describe a usable run (a marker of failure, no
    markers, nothing parsed, or an exit status that contradicts the parsed statuses): not resolved."""
    if any(marker in log for marker in (APPLY_PATCH_FAIL, RESET_FAILED, TESTS_ERROR, TESTS_TIMEOUT)):
        return None
    if START_TEST_OUTPUT not in log or END_TEST_OUTPUT not in log:
        return None
    statuses = parse_log_pytest(log.split(START_TEST_OUTPUT)[1].split(END_TEST_OUTPUT)[0])
    if not statuses:
        statuses = parse_log_pytest(log)
    if not statuses and not SUITE_RAN.search(log):
        return None
    found = TEST_EXIT_CODE_RE.search(log)
    exit_code = int(found.group(1)) if found else None
    if exit_code not in (None, 0) and statuses and not any(s in (FAILED, ERROR) for s in statuses.values()):
        return None  # e.g. a conftest.py printing PASSED lines for a run that failed
    return statuses


def _resolve_case(case: str, statuses: dict[str, str]) -> str | None:
    """The status map's key for `case`; a parametrized id cut short (more '[' than ']') matches the ids it
    starts, when they agree on passing or not."""
    if case in statuses:
        return case
    if case.count("[") > case.count("]"):
        matches = [k for k in statuses if k.startswith(case)]
        if matches and len({statuses[k] in (PASSED, XFAIL) for k in matches}) == 1:
            return matches[0]
    return None


def passed(case: str, statuses: dict[str, str]) -> bool:
    key = _resolve_case(case, statuses)
    return key is not None and statuses[key] in (PASSED, XFAIL)


def maintained(case: str, statuses: dict[str, str]) -> bool:
    """PASS_TO_PASS: a skipped test is no regression (for FAIL_TO_PASS it is no fix)."""
    key = _resolve_case(case, statuses)
    return passed(case, statuses) or (key is not None and statuses[key] == SKIPPED)


def failed(case: str, statuses: dict[str, str]) -> bool:
    key = _resolve_case(case, statuses)
    return key is None or statuses[key] in (FAILED, ERROR, SKIPPED)


def tests_report(statuses: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> dict:
    """{"FAIL_TO_PASS": {"success": [...], "failure": [...]}, "PASS_TO_PASS": {...}, ...}; a test neither
    passed nor failed by the rules lands in neither list, as in swebench."""
    report = {}
    for kind, cases, kept in (("FAIL_TO_PASS", fail_to_pass, passed), ("PASS_TO_PASS", pass_to_pass, maintained)):
        success = [c for c in cases if kept(c, statuses)]
        failure = [c for c in cases if not kept(c, statuses) and failed(c, statuses)]
        report[kind] = {"success": success, "failure": failure}
    # swebench's shape: these two are filled only for its dataset validation (calculate_to_fail)
    return report | {"FAIL_TO_FAIL": {"success": [], "failure": []}, "PASS_TO_FAIL": {"success": [], "failure": []}}


def fraction(part: dict) -> float:
    """Successes over successes and failures; 1 with neither (swebench's compute_fail_to_pass)."""
    total = len(part["success"]) + len(part["failure"])
    return 1.0 if total == 0 else len(part["success"]) / total


def grade(log: str, instance_id: str, fail_to_pass: list[str], pass_to_pass: list[str]) -> dict:
    """The instance's entry of swebench's report.json (get_eval_report with include_tests_status), plus
    `tests`: every test's status as parsed from the log."""
    entry: dict = {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": False, "resolved": False}
    statuses = status_map(log)
    if statuses is None:
        return entry | {"tests": {}}
    report = tests_report(statuses, fail_to_pass, pass_to_pass)
    resolved = fraction(report["FAIL_TO_PASS"]) == 1 and fraction(report["PASS_TO_PASS"]) == 1
    return entry | {"patch_successfully_applied": True, "resolved": resolved, "tests_status": report, "tests": statuses}


def main(argv: list[str]) -> int:
    """grade.py LOG SPEC_JSON OUT_DIR: writes OUT_DIR/report.json (swebench's shape) and reward.json
    (reward 1 when resolved, with the FAIL_TO_PASS and PASS_TO_PASS pass fractions), prints the report."""
    log_path, spec_path, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    entry = grade(log, spec["instance_id"], spec["FAIL_TO_PASS"], spec["PASS_TO_PASS"])
    report = entry.get("tests_status")
    rewards = {
        "reward": 1.0 if entry["resolved"] else 0.0,
        "fail_to_pass": fraction(report["FAIL_TO_PASS"]) if report else 0.0,
        "pass_to_pass": fraction(report["PASS_TO_PASS"]) if report else 0.0,
    }
    (out / "report.json").write_text(json.dumps({spec["instance_id"]: entry}, indent=1) + "\n")
    (out / "reward.json").write_text(json.dumps(rewards) + "\n")
    print(json.dumps({spec["instance_id"]: entry}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
