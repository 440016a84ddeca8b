"""Reading a prompt dataset's rows (furlong.envs.prompts): a JSONL file (one JSON object per line), a Parquet
file (pyarrow), or a local Hugging Face `datasets` dataset (a `save_to_disk` directory, or a folder of data
files such as one downloaded from the Hub), and splitting them into train and held-out rows.

A row keeps where it came from (`FILE line N` for JSONL, `FILE row N` otherwise, counted from 1), so a bad
row's error names its file, its row and the field that is wrong.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Format = Literal["auto", "jsonl", "parquet", "hf"]
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
HELDOUT_DRAW_SEED = 0  # heldout_fraction's draw: fixed, so every run holds out the same rows


class DatasetError(ValueError):
    """A dataset that cannot be read, or a row that is not what the config says; the message names the file
    (and the row and field)."""


@dataclass(frozen=True)
class Row:
    where: str  # "data.jsonl line 3", "data.parquet row 3": what an error about it names
    values: dict[str, Any]


Table = list[Row]


def read_dataset(path: Path, fmt: Format = "auto") -> dict[str, Table]:
    """The rows of `path`: {"": rows} for one table, or a Hugging Face DatasetDict's rows by split name."""
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    kind = fmt if fmt != "auto" else ("hf" if path.is_dir() else SUFFIXES.get(path.suffix.lower()))
    if kind is None:
        raise DatasetError(
            f"{path}: cannot tell the format from the suffix {path.suffix!r}; set format to jsonl, parquet or hf"
        )
    if kind != "hf" and path.is_dir():
        raise DatasetError(f"{path}: a directory, but format {kind} reads a file")
    readers = {"jsonl": _jsonl, "parquet": _parquet, "hf": _hf}
    return readers[kind](path)


def _jsonl(path: Path) -> dict[str, Table]:
    rows = []
    with open(path, encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path} line {n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(value, dict):
                raise DatasetError(
                    f"{path} line {n}: expected a JSON object (one row per line), got {type(value).__name__}"
                )
            rows.append(Row(f"{path} line {n}", value))
    return {"": rows}


def _parquet(path: Path) -> dict[str, Table]:
    import pyarrow as pa  # only a Parquet dataset needs it
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    return {"": _numbered(path, table.to_pylist())}


def _hf(path: Path) -> dict[str, Table]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path}: format hf needs the `datasets` package (pip install datasets)") from None
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        else:  # a folder of data files: datasets infers the builder and the splits from the names, offline
            loaded = datasets.load_dataset(str(path))
    except Exception as exc:  # noqa: BLE001 -- datasets raises many kinds; each is this one error to the user
        raise DatasetError(f"{path}: not a Hugging Face dataset datasets can load: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        return {name: _numbered(path, part.to_list(), f"split {name!r} ") for name, part in loaded.items()}
    return {"": _numbered(path, loaded.to_list())}


def _numbered(path: Path, rows: list[dict], part: str = "") -> Table:
    return [Row(f"{path} {part}row {n}", values) for n, values in enumerate(rows, 1)]


def split_table(
    rows: Table, field: str | None, values: Mapping[str, str], heldout_fraction: float | None, source: str
) -> dict[str, Table]:
    """One table's rows as {"train": ..., "heldout": ...}: by the value of the column `field` (`values`: the
    value of each split; rows of any other value are left out), or `heldout_fraction` of them drawn."""
    if field is not None:
        split_of = {v: k for k, v in values.items()}
        parts: dict[str, Table] = {"train": [], "heldout": []}
        for row in rows:
            if field not in row.values:
                raise DatasetError(
                    f"{row.where}: no field {field!r} (split_field: the row's split, one of {sorted(split_of)})"
                )
            if (split := split_of.get(str(row.values[field]))) is not None:
                parts[split].append(row)
        return parts
    if heldout_fraction is None:
        raise DatasetError(
            f"{source}: one table holds both splits; say which rows are held out (split_field or "
            "heldout_fraction), or give train_path and heldout_path"
        )
    order = list(range(len(rows)))
    random.Random(HELDOUT_DRAW_SEED).shuffle(order)
    held = set(order[: round(heldout_fraction * len(rows))])
    return {
        "train": [r for i, r in enumerate(rows) if i not in held],
        "heldout": [r for i, r in enumerate(rows) if i in held],
    }


def dataset_splits(
    path: Path, fmt: Format, field: str | None, values: Mapping[str, str], heldout_fraction: float | None
) -> dict[str, Table]:
    """Train and held-out rows of one dataset: a DatasetDict's splits named by `values`, else split_table."""
    tables = read_dataset(path, fmt)
    if "" in tables:
        return split_table(tables[""], field, values, heldout_fraction, str(path))
    if field is not None or heldout_fraction is not None:
        raise DatasetError(
            f"{path}: a DatasetDict with splits {sorted(tables)}: its splits are its own (named by "
            f"splits: {dict(values)}); drop split_field and heldout_fraction"
        )
    missing = [name for name in values.values() if name not in tables]
    if missing:
        raise DatasetError(
            f"{path}: a DatasetDict without the splits {missing} (it has {sorted(tables)}); name "
            "its train and held-out splits in splits, e.g. {train: train, heldout: test}"
        )
    return {split: tables[name] for split, name in values.items()}


def file_splits(train: Path, heldout: Path, fmt: Format) -> dict[str, Table]:
    """Train rows from one dataset, held-out rows from another; each one table."""
    parts = {}
    for split, path in (("train", train), ("heldout", heldout)):
        tables = read_dataset(path, fmt)
        if "" not in tables:
            raise DatasetError(
                f"{path}: a DatasetDict with splits {sorted(tables)}; give it as path (its splits "
                "named by splits), not as train_path or heldout_path"
            )
        parts[split] = tables[""]
    return parts


def text_field(row: Row, field: str, what: str, required: bool, numbers: bool = False) -> str | None:
    """The string in `field` of `row` (None when absent and not `required`); DatasetError naming the row and
    field otherwise. `numbers`: an int or float is taken as its text too (an answer such as 42)."""
    value = row.values.get(field)
    if value is None:
        if required:
            raise DatasetError(f"{row.where}: field {field!r} is missing (expected {what}, a string)")
        return None
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise DatasetError(
            f"{row.where}: field {field!r} is {type(value).__name__} {_short(value)}, expected {what}, a string"
        )
    if required and not value.strip():
        raise DatasetError(f"{row.where}: field {field!r} is empty (expected {what})")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
