"""What every subcommand shares: the console, config from flags and overrides, sandbox pieces, errors."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from furlong.config import Config, load_config

console = Console(stderr=True)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="a YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. eval.concurrency=4")


def config_of(args: argparse.Namespace, flags: dict[str, str]) -> Config:
    overrides = list(args.overrides)
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(str(value)) if isinstance(value, Path) else value}")
    return load_config(args.config, overrides)


def sandbox_pieces(cfg: Config):
    from furlong.build import sandbox as build

    warn_limits()
    store = build.image_store(cfg.sandbox, cfg.images)
    return build.sandbox_backend(cfg.sandbox, store), store


def warn_limits() -> None:
    """One line at start when, as an ordinary user, sandboxes will have only rlimits."""
    from furlong.sandbox.runtime.cgroups import no_cgroup_warning

    if warning := no_cgroup_warning():
        console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)


def quiet_library_bars() -> None:
    """furlong's progress only: transformers' and huggingface_hub's own bars ("Loading weights", "Writing
    model shards") off, here and in the engines and ranks this process starts (they inherit the variable,
    which transformers reads at import). A user who sets HF_HUB_DISABLE_PROGRESS_BARS=0 keeps them."""
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") != "1":
        return
    if "transformers" in sys.modules:  # imported already: its switch was read then
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def build_base_image(store) -> None:
    """Builds (or finds) the base image up front, so a missing prerequisite is one line, not N episodes."""
    with console.status("building base image") as status:
        store.base(lambda msg: status.update(msg))


def print_error(exc: BaseException) -> None:
    # escaped: messages quote values such as [1 or [a, b] that rich would read as markup and drop
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
