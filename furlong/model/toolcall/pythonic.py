"""Pythonic calls in Gemma 3 turns (vLLM's pythonic parser and its Gemma 3 tool template): a Python list of
calls with keyword arguments, `[bash(command="ls -la"), read(path='/a', lines=10)]`, in a turn that ends with
<end_of_turn>. The template writes the list first and the turn's text after it; text before it is read too.

A value is a Python literal or JSON (the template writes JSON: `true`, `null`; models write `True`, `None`
and 'single-quoted' strings): strings with Python's escapes, numbers, True/False/None, true/false/null, and
lists, tuples and dicts of them. The template, as transformers renders it, writes no comma between one
call's arguments (`f(a=1b="x")`: its comma flag is set inside a loop, where Jinja forgets it), so the
comma between arguments is optional (an unsigned exponent glued to a key, `a=1e2=3`, is read as the key e2:
JSON and Python write a float's exponent with its sign).
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import Schemas, snippet, without

END_OF_TURN = "<end_of_turn>"
_CONTROL = (END_OF_TURN, "<start_of_turn>", "<bos>", "<eos>")
_START_RE = re.compile(r"\[\s*[A-Za-z_][\w.\-]*\(")  # where a list of calls starts
_NAME_RE = re.compile(r"\s*([A-Za-z_][\w.\-]*)\(")
_KEY_RE = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?([eE][-+]?\d+)?")
_GLUED_KEY_RE = re.compile(r"\w*\s*=")
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_WORD_RE = re.compile("|".join(_NAMES))
_STRING_RE = re.compile(r"""(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")""", re.DOTALL)
_CLOSE = {"[": "]", "(": ")", "{": "}"}


class _Malformed(ValueError):
    """Why the list at `at` does not read; parse turns it into the ToolCallError the model sees."""

    def __init__(self, message: str, at: int) -> None:
        super().__init__(message)
        self.at = at


@dataclass(frozen=True)
class Pythonic:
    name: str = "pythonic"
    turn_ends: tuple[str, ...] = (END_OF_TURN,)
    stops: tuple[str, ...] = (END_OF_TURN,)
    tool_results_need_call: bool = False

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        found = _call_list(text)
        if found is None:
            return []
        start, result = found
        if isinstance(result, _Malformed):
            return ToolCallError(f"the list of calls does not read: {result}", snippet(text, start), None)
        return result[0]

    def answer(self, text: str) -> str:
        return without(text, _CONTROL).strip()

    def outside_calls(self, text: str) -> str:
        """The content beside a turn's calls (the gateway's reply): the text around the list."""
        found = _call_list(text)
        if found is None or isinstance(found[1], _Malformed):
            return self.answer(text)
        end = found[1][1]
        return self.answer(text[: found[0]] + text[end:])


def _call_list(text: str) -> tuple[int, tuple[list[ToolCall], int] | _Malformed] | None:
    """Where the turn's list of calls starts, and its calls and end (or why it does not read)."""
    start = _START_RE.search(text)
    if start is None:
        return None
    try:
        return start.start(), _read_list(text, start.start())
    except _Malformed as e:
        return start.start(), e


def _read_list(text: str, at: int) -> tuple[list[ToolCall], int]:
    at += 1  # past "["
    calls: list[ToolCall] = []
    while True:
        name = _NAME_RE.match(text, at)
        if name is None:
            raise _Malformed(f"call #{len(calls) + 1}: expected NAME(", at)
        args, at = _read_arguments(text, name.end(), f"call #{len(calls) + 1} ({name.group(1)})")
        calls.append(ToolCall(name=name.group(1), arguments=args))
        at = _skip(text, at)
        if text.startswith("]", at):
            return calls, at + 1
        if not text.startswith(",", at):
            raise _Malformed(f"after call #{len(calls)}: expected `,` or `]`", at)
        at += 1


def _read_arguments(text: str, at: int, where: str) -> tuple[dict[str, Any], int]:
    args: dict[str, Any] = {}
    while True:
        at = _skip(text, at)
        if text.startswith(")", at):
            return args, at + 1
        key = _KEY_RE.match(text, at)
        if key is None:
            raise _Malformed(f"{where}: expected KEY=VALUE or `)` (positional arguments are not read)", at)
        if key.group(1) in args:
            raise _Malformed(f"{where}: argument {key.group(1)!r} given twice", at)
        args[key.group(1)], at = _read_value(text, key.end(), f"{where}: argument {key.group(1)!r}")
        at = _skip(text, at)
        at += text.startswith(",", at)  # the template writes none (see the module's docstring)


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _read_value(text: str, at: int, where: str) -> tuple[Any, int]:
    """One literal at `at`, and where it ends."""
    if text[at : at + 1] in ("'", '"'):
        string = _STRING_RE.match(text, at)
        if string is None:
            raise _Malformed(f"{where}: unterminated string", at)
        return _evaluate(string.group(0), where, at), string.end()
    if text[at : at + 1] in _CLOSE:
        end = _closing(text, at, where)
        return _evaluate(text[at:end], where, at), end
    number = _NUMBER_RE.match(text, at)
    if number is not None:
        end = number.end()
        # `a=1e2=3` is 1 and the key e2 (no comma): JSON and Python write an exponent with its sign (1e+16)
        if number.group(1) and number.group(1)[1:2].isdigit() and _GLUED_KEY_RE.match(text, end):
            end = number.start(1)
        return json.loads(text[at:end]), end
    word = _WORD_RE.match(text, at)
    if word is not None:
        return _NAMES[word.group(0)], word.end()
    raise _Malformed(f"{where}: expected a literal (a string, number, True/False/None, list or dict)", at)


def _closing(text: str, at: int, where: str) -> int:
    """Just past the bracket that closes the one at `at` (strings skipped)."""
    depth: list[str] = []
    i = at
    while i < len(text):
        char = text[i]
        if char in ("'", '"'):
            string = _STRING_RE.match(text, i)
            if string is None:
                raise _Malformed(f"{where}: unterminated string", i)
            i = string.end()
            continue
        if char in _CLOSE:
            depth.append(_CLOSE[char])
        elif char in (")", "]", "}"):
            if not depth or depth.pop() != char:
                raise _Malformed(f"{where}: unbalanced {char!r}", i)
            if not depth:
                return i + 1
        i += 1
    raise _Malformed(f"{where}: unterminated {text[at]!r}", at)


def _evaluate(source: str, where: str, at: int) -> Any:
    try:
        with warnings.catch_warnings():  # an unknown escape ("\/") stays as written, quietly
            warnings.simplefilter("ignore", SyntaxWarning)
            return _literal(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError) as e:
        raise _Malformed(f"{where}: not a literal ({e})", at) from None


def _literal(node: ast.expr) -> Any:
    """A Python literal, where true/false/null are JSON's; ValueError for anything else (names, calls)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict's keys must be strings")
        return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"{type(node).__name__} is not a literal")
