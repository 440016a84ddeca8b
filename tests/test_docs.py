"""The docs stay true to the code: the generated config reference, the README's commands, links and cited results."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
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
    "bash install.sh && furlong train                                    # main job: tiny model -> SFT -> GRPO in real "
    "sandboxes -> held-out pass@1",
    "bash install.sh --vllm --harbor --verifiers && python -m pytest -q  # the tests (what CI runs; --vllm adds the vLLM "
    "engine, --harbor the real harbor, --verifiers the verifiers harness's venv)",
    "```",
]

# Pending re-run: the bench engineer commits these; delete this exemption once they are in bench/results/.

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_RESULT = re.compile(r"bench/results/[\w.-]*?\.json")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub gives a page (lower case, punctuation dropped, spaces as hyphens) and its
    explicit `<a id="...">` ones."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced:
            anchors.update(re.findall(r'<a id="([^"]+)"></a>', line))
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


# Figures. A number quoted from a result is followed (on its line, or after its table) by an HTML comment
#   <!-- fig: +37.5 = bench/results/x.json#seeds.0.reward_only.gain_points; 5.5 min = #seeds.0.wall_seconds/60 -->
# Each entry is TEXT = FILE#KEY. TEXT is as printed and must appear between the previous heading or fig
# comment and this one (comments in a row share that scope). KEY is a dotted path into the JSON (list items
# by index), optionally times or divided by a factor; `#KEY` alone reads the FILE named last in the comment.
# Rounding rule: the first number in TEXT has d decimals; the JSON value (scaled) must round to it,
# |value - shown| <= 0.5 * 10**-d, and a leading + must not stand for a negative value.
_FIG = re.compile(r"<!-- fig: (.*?) -->", re.DOTALL)
_FIG_REF = re.compile(r"(?P<file>bench/results/[\w.-]+\.json)?#(?P<key>[^*/\s]+)"
                      r"(?:\s*(?P<op>[*/])\s*(?P<factor>[\d.]+))?")
_SHOWN = re.compile(r"(?P<sign>[+-]?)(?P<int>\d+)(?:\.(?P<dec>\d+))?")
_CITERS = [README, ROOT / "bench" / "README.md", *sorted(DOCS.glob("*.md"))]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Figure:
    page: str
    text: str  # as printed, e.g. "+37.5" or "5.5 min"
    file: str
    key: str
    op: str | None  # "*" or "/" with factor, e.g. seconds / 60 for minutes
    factor: float
    scope: str  # the page's text from the previous heading or fig comment to this one


def _figures(page: Path) -> list[Figure]:
    """Every fig entry on `page`, with the text it must appear in (since the previous heading or fig comment)."""
    text, figures, start, scope_start, name = page.read_text(), [], 0, 0, str(page.relative_to(ROOT))
    for match in _FIG.finditer(text):
        if text[start:match.start()].strip():  # comments in a row (one per table row, say) share one scope
            scope_start = start
        head = max(text.rfind("\n#", 0, match.start()), scope_start)
        scope, start, file = text[head:match.start()], match.end(), None
        for entry in filter(None, (e.strip() for e in match.group(1).split(";"))):
            shown, sep, ref = entry.rpartition(" = ")
            parsed = _FIG_REF.fullmatch(ref.strip())
            assert sep and parsed, f"{name}: fig entry {entry!r} is not 'TEXT = bench/results/FILE.json#KEY'"
            file = parsed["file"] or file
            assert file, f"{name}: fig entry {entry!r} names no file and none came before it in its comment"
            figures.append(Figure(page=name, text=shown.strip(), file=file, key=parsed["key"], op=parsed["op"],
                                  factor=float(parsed["factor"] or 1), scope=scope))
    return figures


def _lookup(fig: Figure) -> float:
    value = json.loads((ROOT / fig.file).read_text())
    for part in fig.key.split("."):
        assert isinstance(value, (dict, list)), f"{fig.file}#{fig.key}: {part!r} is inside a {type(value).__name__}"
        value = value[int(part)] if isinstance(value, list) else value[part]
    assert isinstance(value, (int, float)) and not isinstance(value, bool), (
        f"{fig.file}#{fig.key} is {value!r}, not a number")
    return value * fig.factor if fig.op == "*" else value / fig.factor if fig.op == "/" else value


def _mismatch(fig: Figure) -> str | None:
    """Why the figure is not its JSON's value as printed (None when it is)."""
    shown = _SHOWN.search(fig.text)
    if shown is None:
        return f"{fig.text!r} holds no number"
    if not re.search(r"(?<![\w.])" + re.escape(fig.text) + r"(?![\d])", fig.scope):
        return f"{fig.text!r} does not appear in the text before its comment"
    value = _lookup(fig)
    number = float(f"{shown['sign'] or ''}{shown['int']}.{shown['dec'] or 0}")
    decimals = len(shown["dec"] or "")
    if abs(value - number) > 0.5 * 10 ** -decimals + 1e-9 or (shown["sign"] == "+" and value < 0):
        return f"{fig.text!r} but {fig.file}#{fig.key} gives {value!r}"
    return None


def test_every_cited_figure_is_its_json_value_as_printed():
    figures = [f for page in _CITERS for f in _figures(page)]
    assert len([f for f in figures if f.page == "README.md"]) >= 5, "README.md's figures carry no fig comments"
    wrong = [f"{f.page}: {why}" for f in figures if (why := _mismatch(f))]
    assert not wrong, "figures that differ from their JSON:\n" + "\n".join(wrong)


def test_every_result_json_records_its_provenance_and_is_cited():
    cited = "\n".join(page.read_text() for page in _CITERS)
    bad = []
    for path in sorted(RESULTS.glob("*.json")):
        prov = json.loads(path.read_text()).get("provenance")
        if not (isinstance(prov, dict) and prov.get("command") and prov.get("machine")
                and re.fullmatch(r"[0-9a-f]{40}", str(prov.get("commit")))):
            bad.append(f"{path.name}: no provenance with command, commit (40 hex digits) and machine")
        if f"bench/results/{path.name}" not in cited:
            bad.append(f"{path.name}: cited by no page (README.md, bench/README.md, docs/); archive it")
    assert not bad, "bench/results/ must hold exactly what the docs cite, with provenance:\n" + "\n".join(bad)


def test_no_page_cites_an_archived_result():
    cites = [f"{page.relative_to(ROOT)}: {m}" for page in _CITERS
             for m in re.findall(r"bench/results/archive/[\w.-]+", page.read_text())]
    assert not cites, f"archived results are history, not current figures: {cites}"


# README figures with no JSON behind them, and why; every other decimal or unit-bearing number there needs a fig.
README_NOT_FIGURES = {
    "1.0": "Terminal-Bench 1.0, a version", "3.12": "Python 3.12, a version", "5.2": "GLM-5.2, a model's name",
    "4.2": "the tiny model's 4.2M parameters, a property of the code", "90%": "the bootstrap interval's level",
    "10 min": "the hand-timed default run at 3187ef8, stated as such", "59 s": "the same hand-timed run",
}
_README_NUMBER = re.compile(r"(?<![\w.])[+-]?(?:\d+\.\d+(?:x|%| ?ms| ?min)?|\d+(?:x|%| ?ms| ?min| s\b| points))")


def test_every_number_in_the_readme_is_a_checked_figure():
    text = re.sub(r"<!--.*?-->", "", re.sub(r"```.*?```", "", README.read_text(), flags=re.DOTALL), flags=re.DOTALL)
    checked = {_SHOWN.search(f.text).group(0) for f in _figures(README) if _SHOWN.search(f.text)}
    loose = [n for n in _README_NUMBER.findall(text)
             if n not in README_NOT_FIGURES and _SHOWN.search(n).group(0) not in checked]
    assert not loose, f"README.md quotes figures with no fig comment naming their JSON: {sorted(set(loose))}"
