"""The docs stay true to the code: the generated config reference, the README's commands, links and cited results."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from furlong import config_doc
from furlong.cli.parser import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

FIRST_LINES = [
    "```sh",
    "bash install.sh && furlong train                        # main job: tiny model -> SFT -> GRPO in real sandboxes "
    "-> held-out pass@1",
    "bash install.sh --vllm --harbor && python -m pytest -q  # the tests (what CI runs; --vllm adds the vLLM engine, "
    "--harbor the real harbor)",
    "```",
]

# Pending re-run: the bench engineer commits these; delete this exemption once they are in bench/results/.

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_RESULT = re.compile(r"bench/results/[\w.-]*?\.json")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped, spaces as hyphens."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = sum(1 for a in anchors if a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a))
        anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "furlong") -> dict[str, argparse.ArgumentParser]:
    """Every leaf command `furlong --help` offers, e.g. `furlong image pull`, with its parser."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        return {prefix: parser}
    return {cmd: leaf for name, sub in actions[0].choices.items()
            for cmd, leaf in _subparsers(sub, f"{prefix} {name}").items()}


def _command_cells() -> list[str]:
    """The first cell of each row of the README's command table that runs `furlong`."""
    return [line.split("` |", 1)[0].strip("| `") for line in README.read_text().splitlines()
            if line.startswith("| `furlong ")]


def test_configuration_reference_is_generated_from_the_config_tree():
    committed = (DOCS / "configuration.md").read_text()
    assert committed == config_doc.render(), (
        f"docs/configuration.md is out of date with furlong/config/; regenerate it: {config_doc.REGENERATE}")


def test_configuration_reference_lists_every_key():
    text = config_doc.render()
    for key in ("sandbox.host_uid", "images.pull_timeout_s", "eval.samples", "train.rl.max_staleness",
                "train.sync.momentum", "train.sglang.weights_via", "train.hf.prefix_cache_mb", "train.eval.seed"):
        assert f"| `{key}` |" in text, key
    assert "Generated from `furlong/config/` by `python -m furlong.config_doc" in text


def test_readme_is_a_short_front_page_that_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[:4] == FIRST_LINES


def test_every_relative_link_resolves_to_a_file_and_heading():
    broken = []
    for page in _pages():
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files or headings:\n" + "\n".join(broken)


def test_every_cited_result_json_is_committed():
    cited = {m for page in _pages() for m in _RESULT.findall(page.read_text())}
    assert cited, "the docs cite no bench/results JSON"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"cited but not in bench/results/: {missing}"


def test_readme_command_table_has_every_subcommand():
    cells = _command_cells()
    missing = [cmd for cmd in _subparsers(build_parser()) if not any(c.startswith(cmd) for c in cells)]
    assert not missing, f"README.md's command table lacks: {missing}"


def test_readme_command_table_names_only_real_flags():
    commands = _subparsers(build_parser())
    wrong = []
    for cell in _command_cells():
        name = max((c for c in commands if cell.startswith(c)), key=len, default=None)
        assert name is not None, f"README.md's command table has {cell!r}, which furlong --help does not offer"
        flags = {opt for action in commands[name]._actions for opt in action.option_strings}
        wrong += [f"{name}: {flag}" for flag in re.findall(r"--[a-z][a-z-]*", cell) if flag not in flags]
    assert not wrong, f"README.md's command table names flags furlong does not take: {wrong}"


def test_configuration_reference_renders_undocumented_and_nested_keys():
    class Inner(BaseModel):
        """Knobs of the inner part."""

        mode: Literal["a", "b"] = "a"
        names: tuple[str, ...] = ("x",)

    class Outer(BaseModel):
        count: int = Field(3, ge=1)
        where: Path | None = Field(None, description="a directory | or none")
        inner: Inner = Inner()

    class Root(BaseModel):
        outer: Outer = Outer()

    text = config_doc.render(Root)
    assert "| `outer.count` | int, >= 1 | `3` |  |" in text
    assert "| `outer.where` | path \\| null | `null` | a directory \\| or none |" in text
    assert "## `outer.inner`\n\nKnobs of the inner part." in text
    assert '| `outer.inner.mode` | "a" \\| "b" | `"a"` |' in text
    assert '| `outer.inner.names` | list of str | `["x"]` |' in text
    assert "## `outer`\n\n| key |" in text  # no docstring of its own: no intro, not pydantic's
