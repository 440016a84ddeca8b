"""The package's layers flow one way: the import-linter contracts in pyproject.toml hold, every package
directory is a real package (the linter does not see a directory without __init__.py), and no import of a
furlong module hides inside a function except the few allowed below."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "furlong"

# Function-level imports of furlong modules allowed outside furlong/cli/ (whose lazy imports keep `--help` fast).
# Each defers a heavy third-party import that only one path needs; a cycle is never a reason (the contracts
# see function-level imports too): move the shared piece down instead.
LAZY_ALLOWED = {
    "furlong.model.lora": "peft: only a run with LoRA needs it",
    "furlong.model.loading": "transformers (seconds): `furlong eval` with a scripted agent never loads a model",
    "furlong.engine.hf": "torch and transformers: engine.factory serves vllm and sglang without them",
    "furlong.engine.sglang_launch": "torch (through engine.sglang): only the sglang engine needs it",
    "furlong.build.cluster": "ray (seconds): only train.cluster=ray needs it",
    "furlong.build.openenv": "openenv and gradio (seconds): only train.env.openenv=true needs them",
}


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed: pip install -e '.[test]' (import-linter)"
    return found


def test_import_contracts_hold() -> None:
    # PYTHONPATH: the linter must analyse this checkout's furlong, not another installed copy.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_every_package_directory_has_an_init() -> None:
    missing = sorted(str(d.relative_to(ROOT)) for d in (PACKAGE, *PACKAGE.rglob("*"))
                     if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists())
    assert missing == [], f"no __init__.py (import-linter cannot see these): {missing}"


def _furlong_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "furlong"]
    if node.level or not node.module or node.module.split(".")[0] != "furlong":
        return []
    if node.module == "furlong":  # `from furlong import paths` imports the module furlong.paths
        return [f"furlong.{a.name}" for a in node.names]
    return [node.module]


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a furlong module inside a function body in `path`."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.extend((node.lineno, m) for m in _furlong_modules(node))
    return sorted(set(found))


def test_no_function_level_imports_of_furlong_modules_outside_the_allow_list() -> None:
    used: set[str] = set()
    hidden = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "cli" in path.parents:
            continue
        for line, module in function_level_imports(path):
            if module in LAZY_ALLOWED:
                used.add(module)
            else:
                hidden.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert hidden == [], "import these at the top of the module (a cycle means a shared piece must move down): " \
                         + "; ".join(hidden)
    assert used == set(LAZY_ALLOWED), f"allowed but no longer imported lazily: {set(LAZY_ALLOWED) - used}"


def test_the_scan_finds_an_import_hidden_in_a_method(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text("import os\nfrom furlong.paths import cache_dir\n\n"
                   "class A:\n    async def f(self):\n        from furlong import seeding\n"
                   "        import furlong.sandbox.base, json\n        from . import sibling\n")
    assert function_level_imports(src) == [(6, "furlong.seeding"), (7, "furlong.sandbox.base")]
