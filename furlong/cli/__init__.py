"""The `furlong` command (`furlong.cli:main`; `python -m furlong.cli`)."""

from furlong.cli.main import main

__all__ = ["main"]
