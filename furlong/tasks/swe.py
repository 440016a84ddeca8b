"""SWE-bench-style instances (one JSON object per line) into Harbor task directories (`furlong tasks
import-swe`; docs/swe.md).

Each task's image holds the repository's tracked files at `base_commit` in /testbed (a fresh git repository of
one commit: no later history for the agent to read), its instruction is the problem statement, its solution
applies the gold patch, and its tests/ hold what SWE-bench's evaluation script needs and the agent must not
see before verification: the test patch, the FAIL_TO_PASS and PASS_TO_PASS lists, the test files as they were
at `base_commit`, and the grader (furlong/tasks/swe_grading.py, copied).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from furlong.tasks import swe_grading

DEFAULT_BASE_IMAGE = "debian:bookworm-slim"  # furlong's base: python3 and git (pytest: the verifier toolchain)
TEST_CMD = "pytest --no-header -rA --tb=no -p no:cacheprovider"  # swebench's TEST_PYTEST
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
SPEC_FILE = "swe_instance.json"  # in tests/: marks a task directory this importer wrote
REPO_DIR = "/testbed"  # where SWE-bench's images keep the repository


class SweImportError(ValueError):
    """Bad input to the importer; the message names the file, line and field."""


class _Instance(BaseModel):
    """The standard SWE-bench instance fields; others (hints_text, created_at, difficulty...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    instance_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    repo: str = Field(pattern=r"^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$")
    base_commit: str = Field(pattern=r"^[0-9a-f]{7,40}$")
    patch: str = Field(min_length=1)
    test_patch: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = []
    version: str = ""
    environment_setup_commit: str = ""

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        """SWE-bench's datasets keep the lists as JSON strings; a local file may hold real lists."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("expected a list of test ids, or a JSON string of one") from None
        return value

    @field_validator("version", "environment_setup_commit", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return "" if value is None else str(value) if isinstance(value, int | float) else value


@dataclass(frozen=True)
class SweInstance:
    instance_id: str
    repo: str
    base_commit: str
    patch: str  # the gold patch
    test_patch: str
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    version: str = ""
    environment_setup_commit: str = ""
    line: int = 0  # in the instances file, for errors


def read_instances(path: Path) -> list[SweInstance]:
    """Every instance of a JSONL file, in order; a bad line is an error naming the line and field."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SweImportError(f"{path}: unreadable: {exc}") from None
    out, seen = [], dict[str, int]()
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        inst = _parse_line(path, n, text)
        if inst.instance_id in seen:
            raise SweImportError(
                f"{path}: line {n}: field 'instance_id': {inst.instance_id!r} is also on line {seen[inst.instance_id]}"
            )
        seen[inst.instance_id] = n
        out.append(inst)
    if not out:
        raise SweImportError(f"{path}: no instances (expected one JSON object per line)")
    return out


def _parse_line(path: Path, n: int, text: str) -> SweInstance:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SweImportError(f"{path}: line {n}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SweImportError(f"{path}: line {n}: expected a JSON object, got {type(raw).__name__}")
    try:
        m = _Instance.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1]) or "(top level)"
        got = "" if err["type"] == "missing" else f" (got {str(err.get('input'))[:80]!r})"
        raise SweImportError(f"{path}: line {n}: field {field!r}: {err['msg']}{got}") from None
    return SweInstance(
        instance_id=m.instance_id,
        repo=m.repo,
        base_commit=m.base_commit,
        patch=m.patch,
        test_patch=m.test_patch,
        problem_statement=m.problem_statement,
        fail_to_pass=tuple(m.FAIL_TO_PASS),
        pass_to_pass=tuple(m.PASS_TO_PASS),
        version=m.version,
        environment_setup_commit=m.environment_setup_commit,
        line=n,
    )


@dataclass(frozen=True)
class PatchFiles:
    """What a patch touches, as swebench reads it: `modified` files existed before it (its get_modified_files:
    the test files reset to base_commit), `added` did not, `directives` are the paths the tests run on (its
    get_test_directives: every target path but data files)."""

    modified: tuple[str, ...]
    added: tuple[str, ...]
    directives: tuple[str, ...]


def patch_files(patch: str) -> PatchFiles:
    modified, added, targets, in_header = [], [], [], False
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            in_header = True
            if m := re.match(r"diff --git a/.* b/(.*)", line):
                targets.append(m.group(1))
        elif line.startswith("@@"):
            in_header = False  # hunk lines follow: a removed line may start with "---"
        elif in_header and line.startswith("--- "):
            source = line[4:].split("\t")[0]
            if source == "/dev/null":
                added.append(targets[-1])
            elif source.startswith("a/"):
                modified.append(source[2:])
    directives = tuple(d for d in targets if not d.endswith(NON_TEST_EXTS))
    return PatchFiles(tuple(modified), tuple(added), directives)


def repository(repo_dir: Path, inst: SweInstance, instances: Path) -> Path:
    """The local git repository of `inst.repo`: `repo_dir` itself, or `repo_dir/OWNER/NAME`."""
    for candidate in (repo_dir, repo_dir / inst.repo):
        if (candidate / ".git").exists() or ((candidate / "HEAD").is_file() and (candidate / "objects").is_dir()):
            return candidate
    raise SweImportError(
        f"{instances}: line {inst.line}: field 'repo': no git repository for {inst.repo!r} "
        f"(looked at {repo_dir} and {repo_dir / inst.repo})"
    )


def _git(repo: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # without the user's git configuration: an alias or a setting there must not change what is read
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, **(env or {})}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, check=False)


def snapshot(repo: Path, inst: SweInstance, dest: Path, instances: Path) -> None:
    """The repository's tracked files at base_commit, checked out under `dest` (no history). A checkout
    through a scratch index, not `git archive`: that would drop files marked export-ignore."""
    if _git(repo, "rev-parse", "--verify", "--quiet", f"{inst.base_commit}^{{commit}}").returncode != 0:
        raise SweImportError(
            f"{instances}: line {inst.line}: field 'base_commit': {inst.base_commit} is not a commit of {repo}"
        )
    dest.mkdir(parents=True)
    index = {"GIT_INDEX_FILE": str(dest.parent / ".snapshot-index")}
    try:
        # --work-tree: a bare repository has none of its own
        for args in (("read-tree", inst.base_commit), (f"--work-tree={dest}", "checkout-index", "-a")):
            res = _git(repo, *args, env=index)
            if res.returncode != 0:
                raise SweImportError(
                    f"{instances}: line {inst.line}: git {args[-2]} of {inst.base_commit} in "
                    f"{repo} failed: {res.stderr.decode(errors='replace').strip()}"
                )
    finally:
        Path(index["GIT_INDEX_FILE"]).unlink(missing_ok=True)


def check_applies(testbed: Path, inst: SweInstance, field: str, instances: Path) -> None:
    """`git apply --check` of the instance's `patch` or `test_patch` against the snapshot."""
    text = inst.patch if field == "patch" else inst.test_patch
    # the snapshot is not a repository: git applies to its files as `patch` would, never to a repository
    # the output directory happens to sit in
    env = {"GIT_CEILING_DIRECTORIES": str(testbed.parent)}
    res = subprocess.run(
        ["git", "apply", "--check", "-"],
        input=text.encode(),
        cwd=testbed,
        capture_output=True,
        env={**os.environ, **env},
        check=False,
    )
    if res.returncode != 0:
        raise SweImportError(
            f"{instances}: line {inst.line}: field {field!r}: does not apply at base_commit "
            f"{inst.base_commit}: {res.stderr.decode(errors='replace').strip()[:400]}"
        )


TASK_TOML = """version = "1.0"

[metadata]
source = "swe-bench"
instance_id = {instance_id}
repo = {repo}
base_commit = {base_commit}
version = {version}
environment_setup_commit = {environment_setup_commit}

[agent]
timeout_sec = {agent_timeout}

[verifier]
timeout_sec = {verifier_timeout}

[environment]
network_mode = "no-network"
cpus = 1
memory_mb = 4096

# furlong's: pytest for an image without it, offline (docs/tasks.md, "The offline verifier toolchain")
[furlong]
verifier_toolchain = true
"""

DOCKERFILE = """FROM {base_image}
WORKDIR {repo_dir}
COPY testbed/ {repo_dir}/
RUN git init -q && git add -A -f && \\
    git -c user.name=furlong -c user.email=furlong@localhost commit -q --no-verify -m {message}
"""

SOLVE_SH = """#!/bin/bash
# The gold patch of {instance_id}
cd {repo_dir} && git apply -v "$(dirname "$0")/patch.diff"
"""

# SWE-bench's evaluation script: reset the test files to base_commit, apply the test patch, run the tests
# between the markers, reset again; then grade the log. git reads no configuration but the repository's
# own (the agent's, which could only make the patch fail to apply), and safe.directory keeps the grade
# independent of how the repository's owner looks: root's through the verifier's ownership shim, 65533's
# where the shim does not reach (docs/sandboxes.md, "How ownership looks to the tests").
TEST_SH = """#!/bin/bash
# SWE-bench's evaluation of {instance_id} (written by `furlong tasks import-swe`; docs/swe.md)
mkdir -p /logs/verifier
log=/logs/verifier/test_output.log
reset_tests() {{
  {reset}
}}
{{
  if cd {repo_dir} && reset_tests; then
    if GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null git -c safe.directory='*' apply -v /tests/test.patch; then
      echo '{start}'
      {test_cmd}
      rc=$?
      echo '{end}'
      echo "{exit_code}: $rc"
    else
      echo '{apply_failed}'
    fi
    reset_tests
  else
    echo '{reset_failed}'
  fi
}} > "$log" 2>&1
python3 /tests/grade.py "$log" /tests/{spec} /logs/verifier
"""


@dataclass(frozen=True)
class ImportOptions:
    base_image: str = DEFAULT_BASE_IMAGE  # must have python3 and git
    test_cmd: str = TEST_CMD  # the test files (the directives) are appended
    agent_timeout_s: float = 1800.0
    verifier_timeout_s: float = 900.0


def import_instances(
    instances: Path, repo_dir: Path, out: Path, options: ImportOptions = ImportOptions()
) -> list[Path]:
    """One Harbor task directory per instance under `out`; returns them in the file's order. Every task is
    written before any is put in place, so bad input leaves `out` as it was. A directory this importer
    wrote before is replaced; any other one in the way is an error."""
    parsed = read_instances(instances)
    targets = [out / inst.instance_id for inst in parsed]
    for target in targets:
        if target.exists() and not (target / "tests" / SPEC_FILE).is_file():
            raise SweImportError(f"{target}: exists and was not written by this importer; remove it first")
    repos = [repository(repo_dir, inst, instances) for inst in parsed]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".import-swe.") as tmp:
        staged = [Path(tmp) / inst.instance_id for inst in parsed]
        for inst, repo, task in zip(parsed, repos, staged, strict=True):
            write_task(inst, repo, task, instances, options)
        for task, target in zip(staged, targets, strict=True):
            if target.exists():
                shutil.rmtree(target)
            task.rename(target)
    return targets


def write_task(inst: SweInstance, repo: Path, task: Path, instances: Path, options: ImportOptions) -> None:
    testbed = task / "environment" / "testbed"
    snapshot(repo, inst, testbed, instances)
    for field in ("patch", "test_patch"):
        check_applies(testbed, inst, field, instances)
    files = patch_files(inst.test_patch)
    _write(task / "instruction.md", inst.problem_statement)
    _write(
        task / "task.toml",
        TASK_TOML.format(
            agent_timeout=options.agent_timeout_s,
            verifier_timeout=options.verifier_timeout_s,
            **{
                k: json.dumps(getattr(inst, k))
                for k in ("instance_id", "repo", "base_commit", "version", "environment_setup_commit")
            },
        ),
    )
    _write(
        task / "environment" / "Dockerfile",
        DOCKERFILE.format(
            base_image=options.base_image,
            repo_dir=REPO_DIR,
            message=shlex.quote(f"{inst.instance_id} at {inst.base_commit}"),
        ),
    )
    _write(task / "solution" / "solve.sh", SOLVE_SH.format(instance_id=inst.instance_id, repo_dir=REPO_DIR))
    _write(task / "solution" / "patch.diff", inst.patch)
    tests = task / "tests"
    _write(tests / "test.patch", inst.test_patch)
    for path in files.modified:  # the reset's copies: test files as they were at base_commit
        if (testbed / path).is_file():
            _write_bytes(tests / "base" / path, (testbed / path).read_bytes())
    _write(tests / SPEC_FILE, json.dumps(_spec(inst, files, options), indent=1) + "\n")
    _write(tests / "grade.py", Path(swe_grading.__file__).read_text())
    _write(tests / "test.sh", _test_sh(inst, files, options, has_base=(tests / "base").is_dir()))


def _spec(inst: SweInstance, files: PatchFiles, options: ImportOptions) -> dict:
    return {
        "instance_id": inst.instance_id,
        "repo": inst.repo,
        "base_commit": inst.base_commit,
        "version": inst.version,
        "FAIL_TO_PASS": list(inst.fail_to_pass),
        "PASS_TO_PASS": list(inst.pass_to_pass),
        "test_files": list(files.modified),
        "added_test_files": list(files.added),
        "test_directives": list(files.directives),
        "test_cmd": options.test_cmd,
    }


def _test_sh(inst: SweInstance, files: PatchFiles, options: ImportOptions, has_base: bool) -> str:
    reset = []
    if has_base:
        reset.append(f"cp -r /tests/base/. {REPO_DIR}/")
    if files.added:  # swebench's scripts remove them too: `git apply` refuses to create a file that exists
        reset.append("rm -f -- " + " ".join(shlex.quote(p) for p in files.added))
    return TEST_SH.format(
        instance_id=inst.instance_id,
        repo_dir=REPO_DIR,
        reset=" && ".join(reset) or "true",
        spec=SPEC_FILE,
        test_cmd=" ".join([options.test_cmd, *map(shlex.quote, files.directives)]),
        start=swe_grading.START_TEST_OUTPUT,
        end=swe_grading.END_TEST_OUTPUT,
        exit_code=swe_grading.TEST_EXIT_CODE,
        apply_failed=swe_grading.APPLY_PATCH_FAIL,
        reset_failed=swe_grading.RESET_FAILED,
    )


def _write(path: Path, text: str) -> None:
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
