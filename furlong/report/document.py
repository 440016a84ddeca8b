"""A report as a list of blocks, rendered twice: Markdown (plots as PNG files beside it) and one
self-contained HTML page (the same PNGs embedded as base64)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    name: str  # file name, e.g. reward.png
    png: bytes
    caption: str


Block = Heading | Para | Table | Image


def _md(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}"
    if isinstance(block, Para):
        return block.text
    if isinstance(block, Table):
        lines = ["| " + " | ".join(block.header) + " |", "|" + "---|" * len(block.header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in block.rows])
    return f"![{block.caption}]({block.name})\n\n*{block.caption}*"


def _html(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Para):
        return f"<p>{html.escape(block.text)}</p>"
    if isinstance(block, Table):
        head = "".join(f"<th>{html.escape(h)}</th>" for h in block.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block.rows)
        return f"<table><tr>{head}</tr>{body}</table>"
    data = base64.b64encode(block.png).decode()
    return (
        f'<figure><img alt="{html.escape(block.caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(block.caption)}</figcaption></figure>"
    )


STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "img{max-width:100%}figcaption{font-style:italic;color:#555}"
)


def markdown(blocks: list[Block]) -> str:
    return "\n\n".join(_md(b) for b in blocks) + "\n"


def html_page(title: str, blocks: list[Block]) -> str:
    body = "\n".join(_html(b) for b in blocks)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )
