"""Tool-call formats: how a model family writes tool calls and ends its turns, chosen from the chat template.

`tool_format(tokenizer, name)` gives the format the agent loop (furlong.agent.episode) and SFT demonstrations
(furlong.train.sft) use: `train.agent.tool_format` names one, or `auto` reads the tokenizer's chat template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from furlong.model.chat import ChatTemplateError, end_of_turn_id
from furlong.model.toolcall.base import ToolCallFormat
from furlong.model.toolcall.deepseek import DeepSeekV3
from furlong.model.toolcall.glm45 import Glm45
from furlong.model.toolcall.harmony import Harmony
from furlong.model.toolcall.hermes import Hermes, format_tool_call, parse_tool_calls
from furlong.model.toolcall.llama3 import Llama3Json
from furlong.model.toolcall.pythonic import Pythonic
from furlong.model.toolcall.qwen3_coder import Qwen3Coder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["FORMATS", "ToolCallFormat", "detect_format", "format_tool_call", "parse_tool_calls", "tool_format"]

FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (Hermes(), Qwen3Coder(), Llama3Json(), Harmony(), Pythonic(), DeepSeekV3(), Glm45())
}

# What each family's templates write, tried in this order: Qwen3-Coder's and GLM-4.5's templates write
# <tool_call> too.
SIGNS = (
    ("harmony", ("<|channel|>", "<|message|>")),
    ("glm45", ("<tool_call>", "<arg_key>", "<arg_value>")),
    ("deepseek_v3", ("tool▁calls▁begin", "tool▁sep")),
    ("pythonic", ("<start_of_turn>", "<tool_response>")),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("llama3_json", ("<|start_header_id|>", "<|eot_id|>", "tool_call")),
    ("hermes", ("<tool_call>",)),
)


def detect_format(chat_template: str) -> str | None:
    """The format whose markup `chat_template` writes; None when it writes none of them."""
    return next((name for name, signs in SIGNS if all(s in chat_template for s in signs)), None)


def tool_format(tokenizer: PreTrainedTokenizerBase, name: str = "auto") -> ToolCallFormat:
    """The format `name` names (`auto`: the one the tokenizer's chat template writes), checked against the
    tokenizer: each of its end markers must be one token, or the loop could not stop on it."""
    template = tokenizer.chat_template
    if not template:
        raise ChatTemplateError("tokenizer has no chat template: a tool-call format cannot be chosen")
    text = template if isinstance(template, str) else "\n".join(template.values())  # named templates
    if name == "auto":
        detected = detect_format(text)
        if detected is None:
            signs = "; ".join(f"{n}: {' and '.join(s)}" for n, s in SIGNS)
            raise ChatTemplateError(
                f"train.agent.tool_format=auto cannot tell the tool-call format from the chat "
                f"template: it writes none of the markup looked for ({signs}). Set "
                f"train.agent.tool_format to one of {', '.join(FORMATS)}"
            )
        name = detected
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}: expected auto or one of {', '.join(FORMATS)}")
    fmt = FORMATS[name]
    for marker in dict.fromkeys((*fmt.turn_ends, *fmt.stops)):
        try:
            end_of_turn_id(tokenizer, marker)
        except ChatTemplateError as e:
            raise ChatTemplateError(
                f"tool-call format {name}: {e} (is this the format of this model's chat template?)"
            ) from None
    return fmt
