"""The model layer: tiny-model factory, local loading, chat template, TITO rendering, tool-call parsing."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from furlong.model import (
    ChatTemplateError,
    Message,
    ModelLoadError,
    ToolCall,
    ToolCallError,
    assistant_ids,
    continuation_ids,
    end_of_turn_id,
    format_tool_call,
    init_tiny,
    load_model,
    load_tokenizer,
    parse_tool_calls,
    render_prompt_ids,
)
from furlong.model.chat import common_prefix_len, encode, opens_next_turn, render_text
from furlong.model.tokenizer import CONTROL_TOKENS, MARKUP_TOKENS

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                         "parameters": {"type": "object",
                                                        "properties": {"command": {"type": "string"}},
                                                        "required": ["command"]}}}



@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    return load_tokenizer(tiny_dir)


def test_init_tiny_is_a_plain_hf_checkpoint(tiny_dir: Path) -> None:
    assert (tiny_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert 2_000_000 < model.num_parameters() < 10_000_000
    assert model.config.vocab_size == len(tokenizer)  # every id the model can sample decodes
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert model.generation_config.eos_token_id == [end_of_turn_id(tokenizer),
                                                    tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert next(load_model(tiny_dir).parameters()).dtype.is_floating_point


def test_init_tiny_is_cached_and_guarded(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert init_tiny(tiny_dir) == tiny_dir
    assert time.perf_counter() - t0 < 0.5
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="different spec"):
        init_tiny(tiny_dir, seed=1)
    assert not [p for p in tiny_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left over
    # Default location: <cache>/models/tiny-<hash>; a small variant keeps this test fast.
    monkeypatch.setenv("FURLONG_CACHE_DIR", str(tmp_path))
    built = init_tiny(num_layers=1, corpus_samples=500, stdlib_bytes=50_000)
    assert built.parent == tmp_path / "models" and built.name.startswith("tiny-")
    assert init_tiny(num_layers=1, corpus_samples=500, stdlib_bytes=50_000) == built
    assert AutoModelForCausalLM.from_pretrained(built).config.num_hidden_layers == 1


def test_tokenizer_round_trips_any_text(tok) -> None:
    texts = ["", "plain words", "  leading and trailing  \n\n", "tabs\tand\r\nCRLF", "ünïcödé ✓ 🤖 中文",
             "def f(x):\n    return {'a': [1, 2]}\n", 'printf("%d\\n", x);', "\x00\x01 control bytes",
             '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call><|im_end|>']
    for text in texts:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens_are_single_ids(tok) -> None:
    ids = [encode(tok, t) for t in (*CONTROL_TOKENS, *MARKUP_TOKENS)]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids)
    # Control tokens vanish with skip_special_tokens; tool-call markup stays (the parser needs it).
    text = "<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>"
    assert tok.decode(encode(tok, text), skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"


def test_tokenizer_is_compact_on_agent_text(tok) -> None:
    text = 'grep -rn "error" /var/log | sort | uniq -c\nCreate a file named out.txt with the result.'
    assert len(encode(tok, text)) < len(text) / 2.5


def test_chat_template_renders_tools_calls_and_results(tok) -> None:
    messages = [Message("system", "Be brief."), Message("user", "List files."),
                Message("assistant", "", (ToolCall("bash", {"command": "ls"}),)),
                Message("tool", "a.txt\nb.txt"), Message("tool", "second")]
    text = render_text(tok, messages, tools=[BASH], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(BASH) in text
    assert text.endswith(
        '<|im_start|>user\nList files.<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
        '<|im_end|>\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response>\n'
        '<tool_response>\nsecond\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    plain = render_text(tok, [Message("user", "hi")], add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_incremental_ids_equal_full_render(tok) -> None:
    """The TITO property: prompt + sampled + continuation pieces == one render of the whole conversation."""
    head = [Message("system", "You solve tasks in a terminal."), Message("user", "Count lines in data.txt.")]
    turns = [
        (Message("assistant", "", (ToolCall("bash", {"command": "wc -l data.txt"}),)),
         [Message("tool", "42 data.txt")]),
        (Message("assistant", "<think>\nCheck twice.\n</think>\n\nLet me verify.",
                 (ToolCall("bash", {"command": "cat data.txt | wc -l"}), ToolCall("bash", {"command": "ls"}))),
         [Message("tool", "42"), Message("tool", "data.txt\nnotes ünï 🤖")]),
        (Message("assistant", "", (ToolCall("bash", {"command": "echo 42 > out.txt"}),)),
         [Message("user", "Also tell me the answer.")]),
    ]
    final = Message("assistant", "The answer is 42.")
    ids = render_prompt_ids(tok, head, tools=[BASH])
    history = list(head)
    for reply, answers in turns:
        ids += assistant_ids(tok, reply)  # stands in for the ids the engine sampled
        ids += continuation_ids(tok, answers)
        history += [reply, *answers]
        assert ids == encode(tok, render_text(tok, history, [BASH], add_generation_prompt=True))
    ids += assistant_ids(tok, final)
    full = encode(tok, render_text(tok, [*history, final], [BASH]))
    assert full == ids + encode(tok, "\n")  # the template's newline after the last <|im_end|>
    assert ids[-1] == end_of_turn_id(tok)


def test_continuation_edge_cases(tok) -> None:
    closed = continuation_ids(tok, [Message("tool", "out")], close_turn=True)
    assert closed[0] == end_of_turn_id(tok) and closed[1:] == continuation_ids(tok, [Message("tool", "out")])
    assert continuation_ids(tok, [{"role": "tool", "content": "out"}]) == closed[1:]
    with pytest.raises(ValueError, match="sampled"):
        continuation_ids(tok, [Message("assistant", "no")])
    with pytest.raises(ValueError):
        continuation_ids(tok, [])


def test_common_prefix_len_is_os_path_commonprefix() -> None:
    import os
    import random

    rng = random.Random(0)
    for _ in range(3000):
        a, b = ("".join(rng.choice("ab\u00e9") for _ in range(rng.randint(0, 9))) for _ in range(2))
        assert common_prefix_len(a, b) == len(os.path.commonprefix([a, b])), (a, b)


def test_template_facts_follow_a_swapped_template(tok) -> None:
    """opens_next_turn and end_of_turn_id are kept per tokenizer: a template swapped on the same tokenizer
    object is read afresh."""
    swapped = copy.deepcopy(tok)
    assert not opens_next_turn(swapped, "<|im_end|>")
    swapped.chat_template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                             "{%- if m.role != 'assistant' %}<|im_end|>{% endif %}\n{%- endfor %}")
    assert opens_next_turn(swapped, "<|im_end|>")
    assert end_of_turn_id(swapped) == end_of_turn_id(tok)


def test_history_rewriting_template_is_rejected(tok) -> None:
    forgetful = copy.deepcopy(tok)  # renders only the last message: not append-only
    forgetful.chat_template = ("{{- '<|im_start|>' + messages[-1].role + '\\n' + messages[-1].content "
                               "+ '<|im_end|>\\n' }}{%- if add_generation_prompt %}<|im_start|>assistant\n"
                               "{%- endif %}")
    with pytest.raises(ChatTemplateError, match="rewrites"):
        continuation_ids(forgetful, [Message("tool", "x")])


def test_parse_tool_calls_valid() -> None:
    call = ToolCall("bash", {"command": "ls -la", "timeout": 5})
    text = f"<think>\nlook first\n</think>\n\nSure.\n{format_tool_call(call)}\n{format_tool_call(call)}"
    assert parse_tool_calls(text) == [call, call]
    assert parse_tool_calls("The answer is 4.") == []
    as_string = '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("bash", {"command": "pwd"})]
    assert parse_tool_calls('<tool_call>{"name": "noop", "arguments": {}}</tool_call>') == [ToolCall("noop")]


@pytest.mark.parametrize("text, message", [
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "invalid JSON"),
    ('<tool_call>["bash"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "bash"}</tool_call>', 'missing "arguments"'),
    ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "bash", "arguments": "{nope"}</tool_call>', '"arguments" (a string of JSON): invalid JSON'),
    ('<tool_call>{"name": "bash", "arguments": {}}', "unterminated"),
    ('ok</tool_call>', "without an opening"),
])
def test_parse_tool_calls_errors_are_values(text: str, message: str) -> None:
    result = parse_tool_calls(text)
    assert isinstance(result, ToolCallError) and message in result.message and result.raw


def test_second_call_error_names_its_index() -> None:
    good = format_tool_call(ToolCall("bash", {"command": "ls"}))
    result = parse_tool_calls(good + "<tool_call>{bad}</tool_call>")
    assert isinstance(result, ToolCallError) and result.message.startswith("tool call #2")


def test_loading_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
