"""Extra tools beside bash (Harbor tasks) or a Python environment's own: one runs a command in the
episode's sandbox, one runs Python on the host.

    train:
      env:
        tools: [examples.tools:WORD_COUNT, examples.tools:CALCULATOR]

The model sees their schemas (with train.agent.tool_schema_in_prompt) and calls them as it calls bash;
arguments that do not fit a schema, and a handler that raises or hangs, are tool errors it sees.
"""

from __future__ import annotations

import ast
import operator

from furlong.envs.toolset import Tool

# In the sandbox, as the agent: {path} is shell-quoted in (the model cannot inject a second command).
WORD_COUNT = Tool(
    name="word_count", description="Count the words of a file.",
    parameters={"type": "object", "properties": {"path": {"type": "string", "description": "the file"}},
                "required": ["path"]},
    command="wc -w < {path}")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculate(arguments: dict, sandbox) -> str:
    """On the host: arithmetic only (a parsed expression, never eval). `sandbox` is unused; a handler that
    needs the episode's files would call `await sandbox.exec(...)` (as the agent) in an async handler."""
    result = _value(ast.parse(arguments["expression"], mode="eval").body)  # a bad expression: a tool error
    return f"{result:g}" if isinstance(result, float) else str(result)


CALCULATOR = Tool(
    name="calculator", description="Evaluate an arithmetic expression, e.g. (3 + 4) * 2.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    python=calculate)

TOOLS = [WORD_COUNT, CALCULATOR]
