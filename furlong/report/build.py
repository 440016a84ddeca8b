"""Assembles the sections and writes report.md, report.html and the PNGs into the output directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from furlong.report.data import RunData, load_run
from furlong.report.document import Block, Heading, Image, Para, html_page, markdown
from furlong.report.parts import Section, family_halves, overview, receipts, reward_per_step
from furlong.report.timing import fractions, sample_lag, teacher_cost, time_breakdown
from furlong.report.whatif import compare, projection


@dataclass(frozen=True)
class Written:
    out: Path
    images: tuple[str, ...]
    missing: tuple[str, ...]


def run_sections(run: RunData, speedups: list[float]) -> list[Section]:
    sections = [
        overview(run),
        receipts(run),
        reward_per_step(run),
        family_halves(run),
        time_breakdown(run),
        sample_lag(run),
        fractions(run),
        teacher_cost(run),
    ]
    if speedups:
        sections.append(projection(run, speedups))
    return sections


def _missing_block(sections: list[Section]) -> list[Block]:
    missing = [m for s in sections for m in s.missing]
    if not missing:
        return []
    return [Heading("Not in this report"), *(Para(f"- {m[0].upper()}{m[1:]}.") for m in missing)]


def write_report(out: Path, title: str, sections: list[Section]) -> Written:
    blocks = [b for s in sections for b in s.blocks] + _missing_block(sections)
    out.mkdir(parents=True, exist_ok=True)
    images = [b for b in blocks if isinstance(b, Image)]
    for img in images:
        (out / img.name).write_bytes(img.png)
    for name, text in (("report.md", markdown(blocks)), ("report.html", html_page(title, blocks))):
        tmp = out / f".{name}.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return Written(out, tuple(i.name for i in images), tuple(m for s in sections for m in s.missing))


def report(
    run_dir: Path | None, out: Path | None, compare_runs: tuple[Path, Path] | None, speedups: list[float]
) -> Written:
    """The report of `run_dir` (with a comparison section if `compare_runs`), or a comparison alone."""
    sections: list[Section] = []
    if run_dir is not None:
        sections += run_sections(load_run(run_dir), speedups)
    if compare_runs is not None:
        a, b = (load_run(p) for p in compare_runs)
        if run_dir is None:
            sections.append(Section([Heading(f"furlong report: {a.name} vs {b.name}", 1)]))
        sections.append(compare(a, b))
    if run_dir is not None:
        target, title = out or Path(run_dir) / "report", f"furlong report: {Path(run_dir).name}"
    else:
        assert compare_runs is not None
        target = out or compare_runs[0] / f"compare-{compare_runs[1].name}"
        title = f"furlong report: {compare_runs[0].name} vs {compare_runs[1].name}"
    return write_report(target, title, sections)
