"""Re-tokenization drift through the gateway in each tool-call format (bench/gateway_drift.py): its committed
result has no TITO mismatch over every bundled family and format (and docs/gateway.md quotes it: the fig
comments are checked by tests/test_docs.py); one family's episode through the real gateway, per format, has
none either; and a conversation a format's chat template refuses is a 400 that records nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anthropic
import httpx
import pytest
from host_support import serve_in_thread

from furlong.gateway.app import make_app
from furlong.gateway.policy import Policy
from furlong.model.chat import render_text
from furlong.model.families import FAMILIES as MODEL_FAMILIES
from furlong.model.families import init_family
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.toolcall import FORMATS
from furlong.tasks.family import is_family_dir, load_family

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gateway_drift  # noqa: E402 -- the bench script, found on the path set above

RESULT = ROOT / "bench" / "results" / "gateway_drift.json"
MEASURED = list(FORMATS)
FAMILIES = sorted(p.name for p in (ROOT / "tasks").iterdir() if is_family_dir(p))


def test_the_committed_result_has_no_mismatch_in_any_family_or_format():
    result = json.loads(RESULT.read_text())
    assert sorted(result["formats"]) == sorted(MEASURED) and sorted(result["families"]) == FAMILIES
    assert result["total"]["episodes"] == len(MEASURED) * len(FAMILIES)
    rows = [result["total"], *result["formats"].values(), *result["families"].values()]
    assert all(row["tito_mismatch_tokens"] == 0 for row in rows)
    assert result["total"]["naive"]["tokens_differ"] > 0, "the naive comparison measured nothing"
    with_format = sorted(name for name, fam in MODEL_FAMILIES.items() if fam.tool_format)
    assert sorted(result["model_families"]) == with_format
    assert all(row["tito_mismatch_tokens"] == 0 and row["episodes"] == len(FAMILIES)
               for row in result["model_families"].values())
    # no family's template forks a segment in these episodes: Qwen3's re-rendered turns are continued. GLM-4.5's
    # reads text before a sampled "</think>" as reasoning and drops it at a new user turn (docs/gateway.md)
    assert all(row["history_rewrites"] == 0 for name, row in result["model_families"].items() if name != "glm4_moe")


def test_an_episode_on_qwen3s_own_template_is_one_segment_with_no_mismatch():
    """Qwen3's template re-renders a turn sampled without reasoning once the conversation goes on (its empty
    think block goes): the gateway continues the segment after it (it forked one per such request), appending
    what the template writes for the next turn, and the mismatch check does not count the block."""
    summary = gateway_drift.run_model_family("qwen3", [load_family(ROOT / "tasks" / "make-directory")], 8)
    assert summary["sampled_turns"] == 3 and summary["tito_mismatch_tokens"] == 0
    assert summary["history_rewrites"] == 0


def test_a_qwen3_segment_is_the_templates_render_but_for_the_sampled_think_blocks(tmp_path):
    """Independently of the gateway's own check: the stored ids through the last turn's prompt decode to the
    template's render of the conversation (assistant turns as sampled), once the empty think blocks the model
    sampled, which the template drops from history, are taken out; a changed rendered token is counted."""
    path = init_family("qwen3", tmp_path / "qwen3")
    tok, model = load_tokenizer(path), load_model(path).eval()
    engine = gateway_drift.Forcing(model)
    policy = Policy(engine=engine, tokenizer=tok, fmt=FORMATS["hermes"], name="policy", max_context=4096,
                    default_max_tokens=8)
    app = make_app(policy, gateway_drift.TOKEN)
    server, thread, url = serve_in_thread(app)
    try:
        traj = gateway_drift.episode(url, app, engine, tok, FORMATS["hermes"], "Make a directory.", 1, 8)
    finally:
        server.should_exit = True
        thread.join(30)
    [seg] = traj.segments
    assert len(seg.turns) == 3 and traj.history_rewrites == 0
    last = [i for i, m in enumerate(seg.raw) if m["role"] == "assistant"][-1]
    want = render_text(tok, seg.raw[:last], [gateway_drift.BASH], add_generation_prompt=True)
    got = tok.decode(seg.ids[: seg.turns[-1][0]], skip_special_tokens=False)
    assert "<think>\n\n</think>\n\n" in got and got.replace("<think>\n\n</think>\n\n", "") == want
    assert traj.record_dict()["tito_mismatch_tokens"] == 0
    at = seg.turns[1][0] - 2  # inside the rendered tool result before the second turn
    seg.ids[at] = (seg.ids[at] + 1) % len(tok)
    assert traj.record_dict()["tito_mismatch_tokens"] >= 1


def test_the_bench_measures_every_format():
    assert sorted(gateway_drift.FORMAT_SETUP) == sorted(MEASURED)


@pytest.mark.parametrize("name", MEASURED)
def test_an_episode_in_each_format_has_no_mismatch(tiny_dir, name):
    """A written bash call, its result, two sampled turns with a user turn between (Llama 3's template raised
    on the empty tool_calls list the gateway stored for a plain answer; gpt-oss's refuses the raw sampled
    channel markup the mismatch check rendered: both were 500s)."""
    summary, _ = gateway_drift.run_format(name, tiny_dir, [load_family(ROOT / "tasks" / "make-directory")], 8)
    assert summary["episodes"] == 1 and summary["sampled_turns"] == 3
    assert summary["tito_mismatch_tokens"] == 0 and summary["history_rewrites"] == 0
    assert summary["tito_logprob_abs_error_max"] < 1e-4  # the stored logprobs are the model's


@pytest.fixture(scope="module")
def llama3(tiny_dir):
    """The gateway on the tiny model with Llama 3's template (one tool call per assistant turn, text trimmed)."""
    tok, model = gateway_drift.format_model(tiny_dir, "llama3_json")
    policy = Policy(engine=gateway_drift.Forcing(model), tokenizer=tok, fmt=FORMATS["llama3_json"], name="p",
                    max_context=2048, default_max_tokens=4)
    server, thread, url = serve_in_thread(make_app(policy, gateway_drift.TOKEN))
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {gateway_drift.TOKEN}"}, timeout=60)
    yield url, admin
    server.should_exit = True
    thread.join(30)


def test_a_conversation_the_template_refuses_is_a_400_that_records_nothing(llama3):
    url, admin = llama3
    made = admin.post("/v1/episodes", json={}).json()
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}} for i in (1, 2)]
    body = {"model": "p", "messages": [{"role": "user", "content": "go"},
                                       {"role": "assistant", "content": "", "tool_calls": calls},
                                       {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
            "tools": [gateway_drift.BASH]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {made['api_key']}"},
                   timeout=60)
    assert r.status_code == 400 and "single tool-calls" in r.json()["error"]["message"], r.text
    record = admin.get(f"/v1/episodes/{made['episode_id']}").json()
    assert record["requests"] == 0 and record["segments"] == []


def test_an_anthropic_text_turn_then_a_user_turn_renders_with_llama3(llama3):
    """/v1/messages made a text-only assistant turn with an empty tool_calls list, which Llama 3's template
    raises on: a 500 for every harness resending a plain answer."""
    url, admin = llama3
    made = admin.post("/v1/episodes", json={}).json()
    client = anthropic.Anthropic(base_url=url, api_key=made["api_key"], max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                {"role": "user", "content": "more"}]
    assert client.messages.create(model="p", messages=messages, max_tokens=2).usage.output_tokens >= 1
    record = admin.get(f"/v1/episodes/{made['episode_id']}").json()
    assert record["requests"] == 1 and record["tito_mismatch_tokens"] == 0
