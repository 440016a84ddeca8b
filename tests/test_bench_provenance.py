"""bench/provenance.py records where a result came from, and every bench script that writes a result uses it."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

from provenance import finish, provenance  # noqa: E402


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_provenance_names_the_commit_the_command_and_the_machine(tmp_path: Path, monkeypatch) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-qm", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.setattr(sys, "argv", ["bench/weight_sync.py", "--lrs", "1e-4,2e-4", "--note", "two words"])

    clean = finish(provenance(tmp_path))
    assert clean["commit"] == head and len(head) == 40
    assert clean["dirty"] is False
    assert shlex.split(clean["command"]) == ["python", "bench/weight_sync.py", "--lrs", "1e-4,2e-4", "--note",
                                             "two words"]
    machine = clean["machine"]
    assert machine["cores"] == os.cpu_count() and machine["cores_usable"] >= 1
    assert machine["cpu_model"] and machine["memory_bytes"] > 0
    assert len(machine["loadavg_start"]) == len(machine["loadavg_end"]) == 3
    assert machine["python"] == ".".join(map(str, sys.version_info[:3]))
    assert clean["started_at"].endswith("+00:00") and clean["seconds"] >= 0
    json.dumps(clean)  # what a bench script embeds must serialize as is

    (tmp_path / "a.txt").write_text("two\n")
    assert provenance(tmp_path)["dirty"] is True


def test_provenance_outside_a_checkout_says_so(tmp_path: Path) -> None:
    prov = finish(provenance(tmp_path))
    assert prov["commit"] is None and prov["dirty"] is None


def _writes_results(tree: ast.Module) -> bool:
    """The script names bench/results (a `/ "results"` path, or the directory in its usage text)."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str)
               and (n.value == "results" or "bench/results/" in n.value) for n in ast.walk(tree))


def _embeds_provenance(tree: ast.Module) -> bool:
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    keys = {k.value for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys
            if isinstance(k, ast.Constant)}
    return {"provenance", "finish"} <= calls and "provenance" in keys


def test_every_bench_script_that_writes_a_result_embeds_provenance() -> None:
    scripts = {p.name: ast.parse(p.read_text()) for p in BENCH.glob("*.py") if p.name != "provenance.py"}
    writers = sorted(name for name, tree in scripts.items() if _writes_results(tree))
    assert {"vs_trl.py", "weight_sync.py", "weight_sync_synthetic.py"} <= set(writers)
    missing = [name for name in writers if not _embeds_provenance(scripts[name])]
    assert not missing, f"bench scripts writing bench/results/ without a provenance key: {missing}"
