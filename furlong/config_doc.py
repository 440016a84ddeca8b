"""The configuration reference, generated from the config tree: `python -m furlong.config_doc > docs/configuration.md`.

Every section of `furlong.config.Config` becomes a heading (its class docstring as the intro) and every key a
table row: dotted key, type, default, description. Generating it keeps the reference true to the code;
tests/test_docs.py fails when the committed file differs.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from furlong.config import REPO_ROOT, Config
from furlong.config.base import mapped_class, section_class

REGENERATE = "python -m furlong.config_doc > docs/configuration.md"

_HEADER = f"""# Configuration reference

<!-- Generated from furlong/config/ by `{REGENERATE}`; do not edit by hand. -->

Generated from `furlong/config/` by `{REGENERATE}`.

Every command reads one typed config tree: the defaults below, then a YAML recipe (`--config RECIPE.yaml`,
see `recipes/`) that sets what differs, then `key=value` overrides on the command line, e.g.
`furlong train train.rl.steps=5 train.seed=1`. A key that does not exist, or a value of the wrong type, is an
error naming the key and what was expected. A key's YAML path is its dotted name: `train.rl.steps` is
`train: {{rl: {{steps: 5}}}}` in a recipe.
"""


def _type_name(annotation: Any) -> str:
    """A short, readable spelling of a field's type: `int`, `path | null`, `"sync" | "async"`."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (tuple, list, set, frozenset):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if inspect.isclass(annotation) and issubclass(annotation, Path):
        return "path"
    if inspect.isclass(annotation) and issubclass(annotation, Enum):
        return " \\| ".join(json.dumps(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _bounds(info: FieldInfo) -> str:
    """The field's numeric constraints (pydantic keeps `Field(gt=0)` as annotated-types metadata)."""
    found = [
        f"{sign} {getattr(m, attr)}"
        for m in info.metadata
        for attr, sign in _BOUNDS
        if getattr(m, attr, None) is not None
    ]
    return f", {', '.join(found)}" if found else ""


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]  # the config's factories take no arguments
    elif info.is_required():
        return "required"
    else:
        value = info.default
    if isinstance(value, Path):
        try:
            value = value.relative_to(REPO_ROOT)
        except ValueError:
            pass
        return f"`{value}`"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Enum):
        value = value.value
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections(model: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """The model itself and every nested section under it, depth first, in declaration order (a mapping of
    names to sections as one section, `KEY.<name>`)."""
    found = [(prefix, model)]
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if (child := section_class(info.annotation)) is not None:
            found += _sections(child, key)
        elif (child := mapped_class(info.annotation)) is not None:
            found += _sections(child, f"{key}.<name>")
    return found


def _render_section(key: str, model: type[BaseModel]) -> str:
    lines = [f"## `{key}`", ""]
    # a class's own docstring only: inspect.getdoc would fall back to pydantic's BaseModel docstring
    if doc := model.__dict__.get("__doc__"):
        lines += [" ".join(doc.split()), ""]
    rows = [(name, info) for name, info in model.model_fields.items() if section_class(info.annotation) is None]
    subsections = [name for name, info in model.model_fields.items() if section_class(info.annotation) is not None]
    if rows:
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, info in rows:
            lines.append(
                f"| `{key}.{name}` | {_type_name(info.annotation)}{_bounds(info)} | {_default(info)} | "
                f"{_cell(info.description or '')} |"
            )
        lines.append("")
    if subsections:
        lines += ["Sections: " + ", ".join(f"`{key}.{name}`" for name in subsections) + ".", ""]
    return "\n".join(lines)


def render(root: type[BaseModel] = Config) -> str:
    """The whole reference as markdown, one section per config class under `root`, in the tree's order."""
    parts = [_HEADER]
    parts += [_render_section(key, model) for key, model in _sections(root, "") if key]
    return "\n".join(parts).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
