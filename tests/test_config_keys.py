"""Every config key has an effect: something in furlong/ reads it, and it says what it does."""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

import furlong
from furlong.config import Config

PACKAGE = Path(furlong.__file__).parent

# Keys read generically, not by attribute name; each says by what.
READ_GENERICALLY = {
    "sandbox.backend": "read by the sandbox-backend builder (furlong/build/sandbox.py), which matches on its value",
    "train.rl.max_inflight_groups": "read by RLConfig.inflight_groups(), which the scheduler's builder calls",
}


def _leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, field name) of every leaf of the config tree."""
    out = []
    for name, field in model.model_fields.items():
        node = field.annotation
        if isinstance(node, type) and issubclass(node, BaseModel):
            out += _leaves(node, f"{prefix}{name}.")
        else:
            out.append((prefix + name, name))
    return out


def _names_read() -> set[str]:
    """Attribute names loaded anywhere in the package outside furlong/config/, and getattr's literal names.
    Generic copies by field name (GRPOConfig.of, AgentParams.of) count through the target's own reads."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if PACKAGE / "config" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
    return names


def test_every_config_key_is_read_somewhere():
    read = _names_read()
    dead = [key for key, name in _leaves(Config) if name not in read and key not in READ_GENERICALLY]
    assert not dead, f"config keys nothing in furlong/ reads: {dead}"


def test_the_allow_list_names_real_keys():
    keys = {key for key, _ in _leaves(Config)}
    assert set(READ_GENERICALLY) <= keys


def test_every_config_field_has_a_description():
    def missing(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            if not field.description:
                out.append(prefix + name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                out += missing(field.annotation, f"{prefix}{name}.")
        return out

    assert not missing(Config)
