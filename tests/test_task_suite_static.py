"""Static checks of the bundled task suite in tasks/ (no sandbox).

Running a task (oracle gives reward 1, doing nothing gives 0) needs a sandbox; these tests check only
what can be checked from the files: layout, task.toml, the Dockerfile subset, test.sh always writing a
reward, and that every family's generate() is deterministic and complete.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parent.parent / "tasks"
REQUIRED = ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh", "solution/solve.sh")
CATEGORIES = {"files-text", "pipelines", "python-bugfix", "python-script", "c", "service", "git"}
BASES = {"debian:bookworm", "debian:bookworm-slim", "python:3.11-slim-bookworm"}
APT_LINE = "apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev make"
# Families meant for a tiny model: short instruction, one-line solution.
SIMPLE_FAMILIES = ("create-file-word", "count-lines", "sum-two-numbers", "rename-file", "make-directory",
                   "append-line", "replace-word", "grep-count", "sort-numbers", "count-in-file", "number-stats", "number-words",
                   "transform-text", "text-words")

STATIC = sorted(p for p in TASKS.iterdir() if (p / "task.toml").exists())
FAMILIES = sorted(p for p in TASKS.iterdir() if (p / "family.toml").exists())


def load_generate(family: Path):
    spec = importlib.util.spec_from_file_location(f"family_{family.name.replace('-', '_')}", family / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate


def family_conf(family: Path) -> dict:
    return tomllib.loads((family / "family.toml").read_text())["family"]


def family_seeds(family: Path) -> list[int]:
    conf = family_conf(family)
    return [conf["train_seeds"][0], conf["train_seeds"][0] + 1, conf["heldout_seeds"][0]]


def generated(family: Path, seed: int, tmp_path: Path) -> Path:
    out = tmp_path / f"{family.name}-{seed}"
    out.mkdir()
    load_generate(family)(seed, out)
    return out


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()}


def dockerfile_lines(path: Path) -> list[str]:
    """Logical instruction lines: comments and blank lines dropped, continuations joined."""
    lines, parts = [], []
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        lines.append(" ".join(parts + [stripped]))
        parts = []
    assert not parts, f"{path}: dangling line continuation"
    return lines


def check_task_dir(task: Path) -> None:
    for rel in REQUIRED:
        assert (task / rel).is_file(), f"{task.name}: missing {rel}"
    assert (task / "instruction.md").read_text().strip(), f"{task.name}: empty instruction"
    conf = tomllib.loads((task / "task.toml").read_text())
    assert conf.get("version") == "1.0"
    assert conf["metadata"]["category"] in CATEGORIES, conf["metadata"]
    assert conf["metadata"]["difficulty"] in {"easy", "medium", "hard"}
    assert isinstance(conf["metadata"]["tags"], list) and conf["metadata"]["tags"]
    assert conf["agent"]["timeout_sec"] > 0 and conf["verifier"]["timeout_sec"] > 0
    assert conf["environment"]["cpus"] >= 1 and conf["environment"]["memory_mb"] >= 256
    check_dockerfile(task / "environment" / "Dockerfile")
    test_sh = (task / "tests" / "test.sh").read_text()
    assert test_sh.startswith("#!/bin/bash"), f"{task.name}: test.sh needs a bash shebang"
    assert "mkdir -p /logs/verifier" in test_sh and "/logs/verifier/reward.txt" in test_sh
    # A reward of 0 is written before any check runs, so a crashing check still leaves a reward.
    assert test_sh.index("echo 0 > /logs/verifier/reward.txt") < test_sh.index("echo 1 > /logs/verifier/reward.txt")
    assert (task / "solution" / "solve.sh").read_text().startswith("#!/bin/bash")


def check_dockerfile(path: Path) -> None:
    lines = dockerfile_lines(path)
    assert lines and lines[0].split()[0].upper() == "FROM", f"{path}: must start with FROM"
    assert lines[0].split()[1:] and lines[0].split()[1] in BASES and len(lines[0].split()) == 2, f"{path}: {lines[0]}"
    for line in lines[1:]:
        op, _, args = line.partition(" ")
        op, args = op.upper(), args.strip()
        assert op in {"WORKDIR", "COPY", "ENV", "RUN"}, f"{path}: instruction {op} not allowed"
        assert args, f"{path}: {op} without arguments"
        if op == "WORKDIR":
            assert args.startswith("/"), f"{path}: WORKDIR must be absolute"
        elif op == "COPY":
            assert not args.startswith("--") and not args.startswith("["), f"{path}: plain COPY only"
            *sources, _dst = shlex.split(args)
            assert sources, f"{path}: COPY needs a source and a destination"
            for src in sources:
                assert (path.parent / src).exists(), f"{path}: COPY source {src} does not exist"
        elif op == "ENV":
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", args), f"{path}: ENV must be K=V: {args}"
        elif op == "RUN" and "apt-get" in args:
            assert args == APT_LINE, f"{path}: use exactly `RUN {APT_LINE}` so the layer is shared"


# ---------------------------------------------------------------------------- the suite as a whole


def test_suite_size_and_coverage():
    assert len(STATIC) >= 22, [p.name for p in STATIC]
    assert len(FAMILIES) >= 8, [p.name for p in FAMILIES]
    assert len(STATIC) + len(FAMILIES) >= 30
    counts = {c: 0 for c in CATEGORIES}
    for task in STATIC:
        counts[tomllib.loads((task / "task.toml").read_text())["metadata"]["category"]] += 1
    assert all(n >= 3 for n in counts.values()), counts


def test_no_directory_is_both_task_and_family():
    for path in TASKS.iterdir():
        if path.is_dir():
            assert (path / "task.toml").exists() != (path / "family.toml").exists(), path.name


def test_readme_lists_everything():
    readme = (TASKS / "README.md").read_text()
    for path in STATIC + FAMILIES:
        assert f"`{path.name}`" in readme, f"tasks/README.md does not list {path.name}"


def test_simple_families_exist():
    names = {f.name for f in FAMILIES}
    assert len(names & set(SIMPLE_FAMILIES)) >= 4


# ---------------------------------------------------------------------------- static tasks


@pytest.mark.parametrize("task", STATIC, ids=lambda p: p.name)
def test_static_task(task: Path):
    check_task_dir(task)


# ---------------------------------------------------------------------------- families


@pytest.mark.parametrize("family", FAMILIES, ids=lambda p: p.name)
def test_family_config(family: Path):
    conf = family_conf(family)
    assert conf.get("description")
    ranges = {}
    for split in ("train", "heldout"):
        raw = conf[f"{split}_seeds"]
        assert isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, int) for x in raw) and raw[0] < raw[1]
        ranges[split] = range(*raw)
    assert not set(ranges["train"]) & set(ranges["heldout"]), "train and heldout seeds overlap"
    source = (family / "generate.py").read_text()
    # A family may use the shared task kit, and nothing else of furlong: it stays a plain description.
    imports = re.findall(r"^\s*(?:import|from)\s+(furlong\S*)", source, re.M)
    assert set(imports) <= {"furlong.tasks.kit"}, f"generate.py imports {imports}"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda p: p.name)
def test_family_generates_complete_tasks(family: Path, tmp_path: Path):
    for seed in family_seeds(family):
        check_task_dir(generated(family, seed, tmp_path))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda p: p.name)
def test_family_is_deterministic(family: Path, tmp_path: Path):
    """Same seed, same files: also from another process with another string-hash seed."""
    seed = family_seeds(family)[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = snapshot(generated(family, seed, tmp_path / "a"))
    other = tmp_path / "b" / "other"
    other.mkdir()
    script = ("import importlib.util, pathlib, sys; "
              "spec = importlib.util.spec_from_file_location('g', sys.argv[1]); m = importlib.util.module_from_spec(spec); "
              "spec.loader.exec_module(m); m.generate(int(sys.argv[2]), pathlib.Path(sys.argv[3]))")
    subprocess.run([sys.executable, "-c", script, str(family / "generate.py"), str(seed), str(other)],
                   check=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": "4321"})
    assert first, "generate() wrote nothing"
    assert first == snapshot(other), "same seed, different files"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda p: p.name)
def test_family_instances_differ(family: Path, tmp_path: Path):
    # Fixed-path families may repeat an instruction; the task as a whole (its data) must still differ.
    def fingerprint(task: Path) -> tuple:
        return tuple((str(f.relative_to(task)), f.read_bytes()) for f in sorted(task.rglob("*")) if f.is_file())
    tasks = [fingerprint(generated(family, s, tmp_path)) for s in family_seeds(family)]
    assert len(set(tasks)) == len(tasks), "different seeds gave the same task"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name in SIMPLE_FAMILIES], ids=lambda p: p.name)
def test_simple_family_is_simple(family: Path, tmp_path: Path):
    for seed in family_seeds(family):
        task = generated(family, seed, tmp_path)
        words = len((task / "instruction.md").read_text().split())
        assert words <= 40, f"seed {seed}: instruction has {words} words"
        commands = [l for l in (task / "solution" / "solve.sh").read_text().splitlines()
                    if l.strip() and not l.startswith("#")]
        assert len(commands) == 1, f"seed {seed}: solution is not one line: {commands}"
