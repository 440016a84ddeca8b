"""Progress bars for long work (rich), the same look in every command."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def progress_bar(console: Console, description: str, total: int, completed: int = 0) -> Iterator[Callable[..., None]]:
    """Yields `advance(note="")`: one unit done, with an optional note shown beside the bar."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        job = bar.add_task(description, total=total, completed=completed, note="")

        def advance(note: str = "") -> None:
            bar.update(job, advance=1, note=note)

        yield advance
