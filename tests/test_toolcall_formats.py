"""Tool-call formats against the real published chat templates (furlong/model/templates/, each naming its
source): a call rendered by the template and tokenized parses back to the same call, a malformed one is a
ToolCallError and never an exception, the format is detected from the template, and a multi-turn episode in
each format keeps its sampled ids and appends exactly what the template writes after them."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from conftest import run
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_support import ScriptedTurns, agent_params, make_task
from tokenizers import AddedToken

from furlong.agent.episode import run_episode
from furlong.build.evaluation import model_agents
from furlong.config import load_config
from furlong.engine.base import EngineUnavailable, SamplingParams
from furlong.model.chat import (
    ChatTemplateError,
    Message,
    ToolCall,
    ToolCallError,
    assistant_ids,
    continuation_ids,
    encode,
    render_prompt_ids,
    render_text,
)
from furlong.model.families import DEEPSEEK, GEMMA, GLM
from furlong.model.loading import load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.model.toolcall import FORMATS, detect_format, tool_format
from furlong.sandbox.pool import FreshSandboxes, fixed_image
from furlong.train.sft import FINAL_ANSWER, demo_tokens

TEMPLATES = Path(__file__).parent.parent / "furlong" / "model" / "templates"
# The control tokens each family's real tokenizer has as single ids (Qwen3-Coder's are the tiny model's own).
SPECIAL = {
    "hermes": (),
    "qwen3_coder": (),
    "llama3_json": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                    "<|python_tag|>"),
    "harmony": ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                "<|return|>", "<|call|>"),
    "pythonic": GEMMA,
    "deepseek_v3": DEEPSEEK,
    "glm45": GLM,
}
FIXTURE = {"qwen3_coder": "qwen3_coder.jinja", "llama3_json": "llama3_json.jinja", "harmony": "gpt_oss.jinja",
           "pythonic": "gemma3.jinja", "deepseek_v3": "deepseek_v3.jinja", "glm45": "glm4_5.jinja"}
BOS = {"llama3_json": "<|begin_of_text|>", "pythonic": "<bos>", "deepseek_v3": DEEPSEEK[0]}  # the templates start so
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}
WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "append": {"type": "boolean"}, "meta": {"type": "object"}, "tags": {"type": "array"},
        "ratio": {"type": "number"}, "owner": {"type": ["string", "null"]}}}}}
TOOLS = [BASH, WRITE]

CALLS = [  # one call each: quotes, newlines, a backslash, non-ASCII, nested JSON, every JSON type
    ToolCall("bash", {"command": 'printf "%s\\n" "it\'s" > out.txt && cat out.txt | wc -l'}),
    ToolCall("bash", {"command": "cat <<'EOF' > a.py\nprint('héllo 中文 🤖')\nEOF\npython a.py"}),
    ToolCall("write_file", {"path": "/app/ß.json", "content": '{"k": [1, "two"]}\n', "mode": 420, "append": False,
                            "meta": {"nested": {"list": [1, 2.5, None, True], "quote": "say \"hi\""}},
                            "tags": ["a", "b c"], "ratio": 0.25, "owner": None}),
]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """Per format, a real transformers tokenizer with that family's chat template: the tiny model's tokenizer
    with the family's control tokens added (Hermes: the tiny model's own template)."""
    base = load_tokenizer(init_tiny())
    toks = {"hermes": base}
    for name, fixture in FIXTURE.items():
        tok = copy.deepcopy(base)
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL[name]])
        if name in BOS:
            tok.bos_token = BOS[name]
        tok.chat_template = (TEMPLATES / fixture).read_text()
        toks[name] = tok
    return toks


def calling(*calls: ToolCall, content: str = "") -> Message:
    return Message("assistant", content, calls)


def sampled(tok, name: str, message: Message) -> str:
    """What the model would emit for `message`: the template's rendering, tokenized and decoded."""
    return tok.decode(assistant_ids(tok, message, FORMATS[name].turn_ends), skip_special_tokens=False)


@pytest.mark.parametrize("name", list(FORMATS))
def test_auto_detects_each_template_and_checks_its_markers(tokenizers, name: str) -> None:
    tok = tokenizers[name]
    assert detect_format(tok.chat_template) == name
    assert tool_format(tok).name == name == tool_format(tok, name).name
    other = "llama3_json" if name != "llama3_json" else "harmony"  # its markers are no tokens here
    with pytest.raises(ChatTemplateError, match=f"tool-call format {other}: .* not a single token"):
        tool_format(tok, other)


def test_auto_says_when_it_cannot_tell(tokenizers) -> None:
    plain = copy.deepcopy(tokenizers["hermes"])
    plain.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="train.agent.tool_format=auto cannot tell.*hermes, qwen3_coder"):
        tool_format(plain)
    plain.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tool_format(plain)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("call", CALLS, ids=["quotes", "heredoc-unicode", "nested-types"])
def test_round_trip_through_the_real_template(tokenizers, name: str, call: ToolCall) -> None:
    tok, fmt = tokenizers[name], FORMATS[name]
    text = sampled(tok, name, calling(call))
    assert fmt.parse(text, TOOLS) == [call]
    assert text.endswith(fmt.turn_ends) and any(text.endswith(s) for s in fmt.stops)
    # with the model's words before the call (harmony writes them as an analysis message)
    assert fmt.parse(sampled(tok, name, calling(call, content="First, look.")), TOOLS) == [call]


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "pythonic", "deepseek_v3", "glm45"])
def test_several_calls_in_one_turn(tokenizers, name: str) -> None:
    text = sampled(tokenizers[name], name, calling(*CALLS))
    assert FORMATS[name].parse(text, TOOLS) == CALLS


def test_llama3_calls_separated_by_semicolons_and_the_python_tag(tokenizers) -> None:
    # The Llama 3.1 template renders one call per turn; Llama models (and vLLM's parser) join several with `;`
    tok, fmt = tokenizers["llama3_json"], FORMATS["llama3_json"]
    one, two = (sampled(tok, "llama3_json", calling(c)).removesuffix("<|eot_id|>") for c in CALLS[:2])
    assert fmt.parse(f"<|python_tag|>{one}; {two}<|eom_id|>", TOOLS) == CALLS[:2]
    assert fmt.parse('{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}', TOOLS) == [
        ToolCall("bash", {"command": "ls"})]
    assert fmt.parse("The answer is 4.<|eot_id|>") == []
    assert fmt.answer("The answer is 4.<|eot_id|>") == "The answer is 4."


def test_harmony_as_gpt_oss_writes_it(tokenizers) -> None:
    """gpt-oss puts the recipient after the channel and constrains the content type: read as the template's."""
    fmt = FORMATS["harmony"]
    text = ('<|channel|>analysis<|message|>Need to list.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.bash <|constrain|>json<|message|>{"command": "ls -la /app"}<|call|>')
    assert fmt.parse(text) == [ToolCall("bash", {"command": "ls -la /app"})]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>"
    assert fmt.parse(final) == [] and fmt.answer(final) == "42"


def test_qwen3_coder_reads_values_by_their_schema_type() -> None:
    fmt = FORMATS["qwen3_coder"]

    def one(params: str, tools=(WRITE,)):
        return fmt.parse(f"<tool_call>\n<function=write_file>\n{params}</function>\n</tool_call>", tools)

    # a string parameter stays text whatever it looks like; typed ones are read back
    assert one("<parameter=path>\n42\n</parameter>\n<parameter=mode>\n7\n</parameter>\n") == [
        ToolCall("write_file", {"path": "42", "mode": 7})]
    assert one("<parameter=content>\n[1, 2]\n</parameter>\n<parameter=append>\ntrue\n</parameter>\n") == [
        ToolCall("write_file", {"content": "[1, 2]", "append": True})]
    # untyped (no schema): a JSON object or array is read as one, anything else is text
    assert one("<parameter=x>\n{\"a\": 1}\n</parameter>\n<parameter=y>\n3\n</parameter>\n", tools=()) == [
        ToolCall("write_file", {"x": {"a": 1}, "y": "3"})]
    wrong = one("<parameter=mode>\nrw-r--r--\n</parameter>\n")
    assert isinstance(wrong, ToolCallError) and "parameter 'mode': expected integer" in wrong.message
    assert wrong.name == "write_file"


DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP = DEEPSEEK[5:10]
DS_OUT, DS_OUT_END = DEEPSEEK[12:14]
MALFORMED = [  # (format, text, what the error says)
    ("hermes", '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "invalid JSON"),
    ("hermes", '<tool_call>{"name": "bash", "arguments": {}}', "unterminated"),
    ("qwen3_coder", "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n", "unterminated"),
    ("qwen3_coder", "<tool_call>\n<function=bash>\nls -la\n</function>\n</tool_call>", "text outside <parameter="),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"bash\"}\n</tool_call>", "expected <function=NAME>"),
    ("qwen3_coder", ("<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
                     "<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>"), "given twice"),
    ("qwen3_coder", "<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>", "outside <tool_call>"),
    ("llama3_json", '{"name": "bash", "parameters": {"command": "ls"', "invalid JSON"),
    ("llama3_json", '{"name": "bash", "parameters": ["ls"]}', "must be an object"),
    ("llama3_json", '{"name": "bash", "parameters": {}} and then some words', "expected another call"),
    ("llama3_json", '{"parameters": {"command": "ls"}}', '"name"'),
    ("harmony", '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "ls"', "cut off"),
    ("harmony", "<|channel|>commentary to=functions.bash json<|message|>ls -la<|call|>", "invalid JSON"),
    ("harmony", '<|channel|>commentary to=browser.search<|message|>{"q": "x"}<|call|>', "unknown recipient"),
    ("harmony", '<|channel|>commentary json<|message|>{"command": "ls"}<|call|>', "names no recipient"),
    ("pythonic", '[bash(command="ls")', "expected `,` or `]`"),
    ("pythonic", '[bash("ls")]', "positional arguments"),
    ("pythonic", '[bash(command=ls)]', "expected a literal"),
    ("pythonic", '[bash(command="ls", command="pwd")]', "given twice"),
    ("pythonic", '[bash(command=open("x"))]', "expected a literal"),
    ("pythonic", '[bash(command=["a", f(1)])]', "not a literal"),
    ("pythonic", '[bash(command="ls)]', "unterminated string"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}bash\n```json\n{{"command": "ls"}}\n```{DS_CALL_END}',
     "unterminated"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}bash\n```json\n{{"command": }}\n```{DS_CALL_END}{DS_CALLS_END}',
     "invalid JSON"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}bash\n{{"command": "ls"}}{DS_CALL_END}{DS_CALLS_END}',
     "```json"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}bash\n```json\n["ls"]\n```{DS_CALL_END}{DS_CALLS_END}',
     "expected a JSON object"),
    ("deepseek_v3", f"{DS_CALLS}ls -la{DS_CALLS_END}", "text between the calls"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}bash{DS_SEP}{{"command": }}{DS_CALL_END}{DS_CALLS_END}', "invalid JSON"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}bash{DS_SEP}["ls"]{DS_CALL_END}{DS_CALLS_END}', "expected a JSON object"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}{DS_SEP}{{"command": "ls"}}{DS_CALL_END}{DS_CALLS_END}', "no function name"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}tool{DS_SEP}bash\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}', "unknown call type"),
    ("deepseek_v3", f"{DS_CALL}function{DS_SEP}bash\n```json\n{{}}\n```{DS_CALL_END}", "outside"),
    ("glm45", "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n", "unterminated"),
    ("glm45", "<tool_call>bash\nls -la\n</tool_call>", "text outside <arg_key>"),
    ("glm45", "<tool_call>\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>", "name"),
    ("glm45", ("<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n<arg_key>command</arg_key>\n"
               "<arg_value>pwd</arg_value>\n</tool_call>"), "given twice"),
    ("glm45", "<tool_call>write_file\n<arg_key>mode</arg_key>\n<arg_value>rw</arg_value>\n</tool_call>",
     "expected integer"),
    ("glm45", "<arg_key>command</arg_key>\n<arg_value>ls</arg_value>", "outside <tool_call>"),
]


@pytest.mark.parametrize("name, text, message", MALFORMED)
def test_malformed_calls_are_errors_the_model_sees(name: str, text: str, message: str) -> None:
    result = FORMATS[name].parse(text, TOOLS)
    assert isinstance(result, ToolCallError) and message in result.message and result.raw


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "bash", "arguments": ', "{", "}", '"', "\\", "[1]", "\n"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=bash>", "<function=", "</function>", ">", "\n",
                    "<parameter=command>", "<parameter=mode>", "</parameter>", "True", "{", "[", "None"],
    "llama3_json": ["<|python_tag|>", '{"name": "bash", "parameters": ', "{", "}", ";", '"', "\\u12", "<|eot_id|>",
                    "[", "null", "1e999", " "],
    "harmony": ["<|start|>", "assistant", "<|channel|>", "commentary", " to=functions.bash", " to=", "<|message|>",
                "<|constrain|>json", "<|call|>", "<|end|>", "<|return|>", "final", '{"command": "ls"}', "{", "\n"],
    "pythonic": ["[", "]", "bash(", "(", ")", "command=", "=", ",", '"', "'", "\\", "True", "null", "{", "}", "1e5",
                 "<end_of_turn>", "\n"],
    "deepseek_v3": [DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "function", "bash", "\n```json\n", "\n```",
                    '{"command": "ls"}', "{", "}", DEEPSEEK[1], "\n"],
    "glm45": ["<tool_call>", "</tool_call>", "bash", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "mode",
              "command", "7", "{", "[", "\n", "<|observation|>", "<think>", "</think>"],
}


@pytest.mark.parametrize("name", list(FORMATS))
@settings(max_examples=150, deadline=None, database=None)
@given(data=st.data())
def test_parse_never_raises(name: str, data) -> None:
    pieces = st.one_of(st.sampled_from(FRAGMENTS[name]), st.text(max_size=4))
    text = "".join(data.draw(st.lists(pieces, max_size=24)))
    fmt = FORMATS[name]
    result = fmt.parse(text, TOOLS)
    assert isinstance(result, ToolCallError) or all(
        isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in result)
    assert isinstance(fmt.answer(text), str)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False, width=32),
                     st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=12))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=8)
_KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)
_KIND = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
         dict: "object"}


@pytest.mark.parametrize("name", list(FORMATS))
@settings(max_examples=30, deadline=None, database=None)
@given(args=st.dictionaries(_KEYS, _JSON, max_size=4))
def test_any_arguments_round_trip(tokenizers, name: str, args: dict) -> None:
    tok = tokenizers[name]
    # Qwen3-Coder's values are typed by the schema, as a real tool's would be
    schema = {"type": "function", "function": {"name": "tool", "parameters": {"type": "object", "properties": {
        k: {"type": _KIND[type(v)]} for k, v in args.items()}}}}
    text = sampled(tok, name, calling(ToolCall("tool", args)))
    assert FORMATS[name].parse(text, [schema]) == [ToolCall("tool", json.loads(json.dumps(args)))]


@pytest.mark.parametrize("name", list(FORMATS))
def test_incremental_ids_equal_the_full_render(tokenizers, name: str) -> None:
    """Prompt + sampled turns + continuations, rendered piece by piece, are what the template renders for the
    whole conversation: for a chain of calls in every format (harmony keeps a call's analysis until a final
    answer), and for a user turn after an answer (harmony: see test_harmony_continues_after_a_final_answer)."""
    tok, fmt = tokenizers[name], FORMATS[name]
    history = [Message("system", "You solve tasks."), Message("user", "Count lines in data.txt.")]
    ids = render_prompt_ids(tok, history, tools=TOOLS)
    steps = [(calling(CALLS[0], content="Let me count."), [Message("tool", "42 data.txt")]),
             (calling(CALLS[2]), [Message("tool", "exit code 0\nwritten ünï 🤖")])]
    if name != "harmony":
        steps.append((Message("assistant", "It has 42 lines."), [Message("user", "And words?")]))
    for reply, answers in steps:
        ids += assistant_ids(tok, reply, fmt.turn_ends)  # stands in for the ids the engine sampled
        ids += continuation_ids(tok, answers, end_of_turn=fmt.turn_ends, answered=reply)
        history += [reply, *answers]
        assert tok.decode(ids, skip_special_tokens=False) == render_text(tok, history, TOOLS, add_generation_prompt=True)


def test_harmony_continues_after_a_final_answer(tokenizers) -> None:
    """The template writes a conversation's last answer with <|return|> and, once the conversation goes on,
    with <|end|> and without the analysis of earlier calls. furlong keeps the sampled <|return|> and analysis
    (the policy's own tokens) and appends exactly what the template writes after the answer."""
    tok, ends = tokenizers["harmony"], FORMATS["harmony"].turn_ends
    head = [Message("system", "s"), Message("user", "What is 6 x 7?")]
    call, answer = calling(ToolCall("bash", {"command": "echo $((6*7))"}), content="Compute."), Message("assistant", "42")
    ids = render_prompt_ids(tok, head) + assistant_ids(tok, call, ends)
    ids += continuation_ids(tok, [Message("tool", "42")], end_of_turn=ends, answered=call)
    ids += assistant_ids(tok, answer, ends)
    assert ids[-1] == encode(tok, "<|return|>")[0]
    follow = continuation_ids(tok, [Message("user", "And 6 x 8?")], end_of_turn=ends, answered=answer)
    assert tok.decode(follow, skip_special_tokens=False) == "<|start|>user<|message|>And 6 x 8?<|end|><|start|>assistant"
    text = tok.decode(ids + follow, skip_special_tokens=False)
    rerender = render_text(tok, [*head, call, Message("tool", "42"), answer, Message("user", "And 6 x 8?")],
                           add_generation_prompt=True)
    assert "Compute." in text and "Compute." not in rerender  # the re-render drops the call's analysis
    assert text.replace("<|return|>", "<|end|>").replace(
        "<|start|>assistant<|channel|>analysis<|message|>Compute.<|end|>", "") == rerender


BROKEN = {"hermes": '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call><|im_end|>',
          "qwen3_coder": "<tool_call>\n<function=bash>\nls\n</function>\n</tool_call><|im_end|>",
          "llama3_json": '{"name": "bash", "parameters": {"command": }<|eot_id|>',
          "harmony": "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{command: ls}<|call|>",
          "pythonic": "[bash(command=ls)]<end_of_turn>",
          "glm45": "\n<think></think>\n<tool_call>bash\nls\n</tool_call><|observation|>",
          "deepseek_v3": f"{DS_CALLS}{DS_CALL}bash{DS_SEP}{{command: ls}}{DS_CALL_END}{DS_CALLS_END}{DEEPSEEK[1]}"}


@pytest.mark.parametrize("name", list(FORMATS))
def test_multi_turn_episode_is_token_exact(tokenizers, name: str, backend, base_image, tmp_path) -> None:
    """A real episode in each format (real sandbox, real tool results): the sampled ids stay verbatim with
    loss mask 1, each prompt is the last one + the sampled ids + the template's continuation, a malformed
    call is a tool error the model reads, and the conversation up to it is exactly the template's render."""
    tok, fmt = tokenizers[name], FORMATS[name]
    first = calling(ToolCall("bash", {"command": "mkdir -p /app && echo made"}), content="Make the dir.")
    turns = [assistant_ids(tok, first, fmt.turn_ends), encode(tok, BROKEN[name]),
             assistant_ids(tok, calling(ToolCall("bash", {"command": "echo hi > /app/out.txt && cat /app/out.txt"})),
                           fmt.turn_ends),
             assistant_ids(tok, Message("assistant", "Done."), fmt.turn_ends)]
    policy = ScriptedTurns(turns)
    task = make_task(tmp_path, f"fmt-{name}", "Write hi to /app/out.txt",
                     test="grep -q hi /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")
    params = agent_params(max_turns=5, max_context_tokens=4096, tool_format="auto")
    ep = run(run_episode(task, policy, tok, FreshSandboxes(backend, fixed_image(base_image)), params, SamplingParams()))
    assert (ep.status, ep.reward, ep.turns, ep.tool_errors) == ("ok", 1.0, 4, 1)
    for before, after, out in zip(policy.prompts, policy.prompts[1:], turns):
        assert after[:len(before) + len(out)] == before + out  # never re-tokenized
    assert [t for t, m in zip(ep.tokens, ep.loss_mask) if m] == [t for turn in turns for t in turn]
    assert list(ep.tokens) == policy.prompts[-1] + turns[-1]
    history = [Message("system", params.system_prompt), Message("user", task.instruction), first,
               Message("tool", "exit code 0\nmade")]
    assert tok.decode(policy.prompts[1], skip_special_tokens=False) == render_text(tok, history,
                                                                                   add_generation_prompt=True)
    error = FORMATS[name].parse(BROKEN[name])
    assert isinstance(error, ToolCallError)
    text = tok.decode(ep.tokens, skip_special_tokens=False)
    for observation in (f"error: {error.message}", "exit code 0\nhi"):  # Llama's and harmony's as JSON strings
        assert observation in text or json.dumps(observation, ensure_ascii=False)[1:-1] in text


def test_eval_names_a_template_it_cannot_read_before_loading_the_model(tokenizers, tmp_path) -> None:
    plain = copy.deepcopy(tokenizers["hermes"])
    plain.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    plain.save_pretrained(tmp_path)  # a tokenizer and no weights: the format is checked first
    cfg = load_config(overrides=["eval.agent=model", f"eval.model={tmp_path}"])
    with pytest.raises(EngineUnavailable, match="--model: train.agent.tool_format=auto cannot tell"):
        model_agents(cfg)
    cfg = load_config(overrides=["eval.agent=model", f"eval.model={tmp_path}", "train.agent.tool_format=harmony"])
    with pytest.raises(EngineUnavailable, match=re.escape("tool-call format harmony: '<|end|>' is not a single token")):
        model_agents(cfg)


@pytest.mark.parametrize("name", list(FORMATS))
def test_sft_demonstrations_are_laid_out_in_the_models_format(tokenizers, name: str, tmp_path) -> None:
    """An oracle demonstration is the episode a model would have: prompt, its call, the real observation and
    a final answer, each turn's ids masked as sampled, and the whole exactly the template's render."""
    tok, params = tokenizers[name], agent_params()
    task = make_task(tmp_path, "demo", "Write hi to /app/out.txt", test="true")
    demo = demo_tokens(tok, task, "echo hi > /app/out.txt", "exit code 0", params)
    call = calling(ToolCall("bash", {"command": "echo hi > /app/out.txt"}))
    conversation = [Message("system", params.system_prompt), Message("user", task.instruction), call,
                    Message("tool", "exit code 0"), Message("assistant", FINAL_ANSWER)]
    full = render_text(tok, conversation).rstrip("\n")
    if name == "glm45":  # the answer ends with the role of what would follow it: the template writes no end
        full += "<|user|>"
    assert tok.decode(demo.tokens, skip_special_tokens=False) == full
    start = demo.loss_mask.index(1)  # the first taught turn: the call
    taught = tok.decode(demo.tokens[start:demo.loss_mask.index(0, start)], skip_special_tokens=False)
    assert FORMATS[name].parse(taught, TOOLS) == [call.tool_calls[0]]
    assert sum(demo.loss_mask) == len(assistant_ids(tok, call, FORMATS[name].turn_ends)) + len(
        assistant_ids(tok, Message("assistant", FINAL_ANSWER), FORMATS[name].turn_ends))


def test_pythonic_reads_what_gemma_models_write() -> None:
    """Python literals as a model writes them (single quotes, True/None, commas), text before the list, and
    the template's own comma-less JSON form (`f(a=1b=true)`); an answer with no list of calls is an answer."""
    fmt = FORMATS["pythonic"]
    text = (
        "Let me look.\n[bash(command='echo \\'hi\\'\\n'), write_file(path=\"/a\", mode=-7, append=True, owner=None, "
        "tags=('x', 2.5e3), meta={'k': [null, false]})]<end_of_turn>"
    )
    assert fmt.parse(text, TOOLS) == [
        ToolCall("bash", {"command": "echo 'hi'\n"}),
        ToolCall(
            "write_file",
            {
                "path": "/a",
                "mode": -7,
                "append": True,
                "owner": None,
                "tags": ["x", 2500.0],
                "meta": {"k": [None, False]},
            },
        ),
    ]
    assert fmt.parse('[w(a=1e2=3b=truec="x")]', TOOLS) == [ToolCall("w", {"a": 1, "e2": 3, "b": True, "c": "x"})]
    assert fmt.parse("[]", TOOLS) == [] and fmt.parse("The list is [1, 2].<end_of_turn>") == []
    assert fmt.answer("The list is [1, 2].<end_of_turn>") == "The list is [1, 2]."
    assert fmt.outside_calls(text) == "Let me look."  # type: ignore[attr-defined]


def test_deepseek_v3s_turns_render_turn_by_turn(tokenizers) -> None:
    """DeepSeek-V3.1's own template: the generation prompt closes the (skipped) think block, a call turn ends
    with <|tool▁calls▁end|><|end▁of▁sentence|>, tool results follow with no generation prompt (the model answers
    right after them), and the arguments render as their JSON text (OpenAI's string form, which the template
    concatenates)."""
    tok, ends = tokenizers["deepseek_v3"], FORMATS["deepseek_v3"].turn_ends
    head = [Message("system", "s"), Message("user", "u")]
    assert render_text(tok, head, add_generation_prompt=True).endswith(DEEPSEEK[4] + "</think>")
    call = calling(ToolCall("bash", {"command": "ls"}), content="Look.")
    assert tok.decode(assistant_ids(tok, call, ends)) == (
        f'Look.{DS_CALLS}{DS_CALL}bash{DS_SEP}{{"command": "ls"}}{DS_CALL_END}{DS_CALLS_END}{DEEPSEEK[1]}'
    )
    results = [Message("tool", "a"), Message("tool", "b")]
    assert tok.decode(continuation_ids(tok, results, end_of_turn=ends, answered=call)) == (
        f"{DS_OUT}a{DS_OUT_END}{DS_OUT}b{DS_OUT_END}"
    )


def test_deepseek_v3_also_reads_deepseek_v3s_own_call_body() -> None:
    """DeepSeek-V3's (pre-3.1) template and vLLM's deepseek_v3 parser write `function<sep>NAME` and a ```json
    block: a checkpoint with that template (tool_format=auto picks deepseek_v3 for it) is read too."""
    text = (f'Hi{DS_CALLS}{DS_CALL}function{DS_SEP}bash\n```json\n{{"command": "ls"}}\n```{DS_CALL_END}\n'
            f'{DS_CALL}write_file{DS_SEP}{{"path": "a"}}{DS_CALL_END}{DS_CALLS_END}{DEEPSEEK[1]}')
    calls = [ToolCall("bash", {"command": "ls"}), ToolCall("write_file", {"path": "a"})]
    assert FORMATS["deepseek_v3"].parse(text) == calls
    # V3.1 arguments written over several lines (a string holding ```json)
    pretty = f'{DS_CALLS}{DS_CALL}bash{DS_SEP}{{"command":\n"cat <<EOF\\n```json\\n{{}}\\n```"\n}}{DS_CALL_END}{DS_CALLS_END}'
    assert FORMATS["deepseek_v3"].parse(pretty) == [ToolCall("bash", {"command": "cat <<EOF\n```json\n{}\n```"})]


def test_glm45_turns_end_with_the_next_messages_role(tokenizers) -> None:
    """GLM-4.5's template writes no end marker after an assistant turn: a call ends with <|observation|> (the
    tool results' role), an answer with <|user|>, and the continuation starts after it; a cut-off turn is
    closed with the role of what follows it."""
    tok, ends = tokenizers["glm45"], FORMATS["glm45"].turn_ends
    call, answer = calling(CALLS[0], content="Look."), Message("assistant", "Done.")
    assert tok.decode(assistant_ids(tok, call, ends)).endswith("</tool_call><|observation|>")
    assert tok.decode(assistant_ids(tok, answer, ends)).endswith("Done.<|user|>")
    result, more = Message("tool", "out"), Message("user", "More?")
    assert (
        tok.decode(continuation_ids(tok, [result], end_of_turn=ends, answered=call))
        == "\n<tool_response>\nout\n</tool_response><|assistant|>"
    )
    closed = continuation_ids(tok, [more], close_turn=True, end_of_turn=ends, answered=answer)
    assert tok.decode(closed) == "<|user|>More?<|assistant|>"
    closed = continuation_ids(tok, [result], close_turn=True, end_of_turn=ends, answered=call)
    assert tok.decode(closed).startswith("<|observation|>\n<tool_response>")
    assert FORMATS["glm45"].answer("\n<think>hmm</think>\nIt is 4.<|user|>") == "<think>hmm</think>\nIt is 4."
