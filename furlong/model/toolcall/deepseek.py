"""DeepSeek-V3's calls: after any text, one block of calls, the turn then ending with <|end▁of▁sentence|> (the
bars in DeepSeek's tokens are fullwidth: see _token). DeepSeek-V3.1's template (the family's fixture) writes

    <|tool▁calls▁begin|><|tool▁call▁begin|>NAME<|tool▁sep|>{...}<|tool▁call▁end|><|tool▁call▁begin|>NAME2...
    <|tool▁call▁end|><|tool▁calls▁end|>

and DeepSeek-V3's own (and vLLM's deepseek_v3 parser) the older body `function<|tool▁sep|>NAME` + newline + the
arguments in a ```json block; both are read. The arguments are a JSON object; whitespace between the calls is
allowed (vLLM's indented tool template writes some).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import Schemas, json_object, snippet, unpaired, without


def _token(name: str) -> str:
    return f"<｜{name}｜>"  # noqa: RUF001 -- fullwidth bars, as DeepSeek's tokenizer writes them


CALLS_BEGIN, CALLS_END = _token("tool▁calls▁begin"), _token("tool▁calls▁end")
CALL_BEGIN, CALL_END, SEP = _token("tool▁call▁begin"), _token("tool▁call▁end"), _token("tool▁sep")
EOS = _token("end▁of▁sentence")
_CONTROL = (EOS, _token("begin▁of▁sentence"), _token("Assistant"), _token("User"), _token("tool▁outputs▁end"))
_BLOCK_RE = re.compile(re.escape(CALLS_BEGIN) + "(.*?)" + re.escape(CALLS_END), re.DOTALL)
_CALL_RE = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.DOTALL)
_BODY_RE = re.compile(r"(\w*)" + re.escape(SEP) + r"([^\n]*)\n```(?:json)?\n(.*)\n```", re.DOTALL)
_BODY_V31_RE = re.compile(r"([^\n]*?)" + re.escape(SEP) + r"(.*)", re.DOTALL)  # NAME<sep>JSON


@dataclass(frozen=True)
class DeepSeekV3:
    name: str = "deepseek_v3"
    turn_ends: tuple[str, ...] = (EOS,)
    stops: tuple[str, ...] = (EOS,)
    tool_results_need_call: bool = False

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        calls: list[ToolCall] = []
        for block in _BLOCK_RE.finditer(text):
            stray = _CALL_RE.sub("", block.group(1)).strip()
            if stray:
                return ToolCallError(
                    f"text between the calls in {CALLS_BEGIN}...{CALLS_END}: {stray[:80]!r}", block.group(1)
                )
            for match in _CALL_RE.finditer(block.group(1)):
                call = _parse_call(match.group(1), f"tool call #{len(calls) + 1}")
                if isinstance(call, ToolCallError):
                    return call
                calls.append(call)
        rest = _BLOCK_RE.sub("", text)
        unclosed = unpaired(rest, CALLS_BEGIN, CALLS_END)
        if unclosed is None and (CALL_BEGIN in rest or CALL_END in rest):
            return ToolCallError(f"a call outside {CALLS_BEGIN}...{CALLS_END}", snippet(rest))
        return unclosed or calls

    def answer(self, text: str) -> str:
        return without(text, _CONTROL).strip()

    def outside_calls(self, text: str) -> str:
        """The content beside a turn's calls (the gateway's reply): the text before them."""
        return self.answer(_BLOCK_RE.sub("", text))


def _parse_call(body: str, where: str) -> ToolCall | ToolCallError:
    body = body.strip()
    v3 = _BODY_RE.fullmatch(body)  # DeepSeek-V3's function<sep>NAME + a ```json block
    if v3 is not None and v3.group(1) == "function":
        return _call(v3.group(2).strip(), v3.group(3), where, body)
    # DeepSeek-V3.1's NAME<sep>{...}
    v31 = _BODY_V31_RE.fullmatch(body)
    if v31 is not None and v31.group(2).lstrip().startswith(("{", "[")):
        return _call(v31.group(1).strip(), v31.group(2), where, body)
    if v3 is not None:
        return ToolCallError(
            f"{where}: unknown call type {v3.group(1)!r} (expected function)", body, v3.group(2).strip() or None
        )
    return ToolCallError(
        f"{where}: expected NAME{SEP} then the arguments as a JSON object (or DeepSeek-V3's function{SEP}NAME, "
        "then the arguments in a ```json block)",
        body,
    )


def _call(name: str, arguments: str, where: str, body: str) -> ToolCall | ToolCallError:
    if not name:
        return ToolCallError(f"{where}: no function name", body)
    args = json_object(arguments, where, name, body)
    return args if isinstance(args, ToolCallError) else ToolCall(name=name, arguments=args)
