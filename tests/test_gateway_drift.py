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
from furlong.model.families import FAMILIES as MODEL_FAMILIES
from furlong.model.toolcall import FORMATS
from furlong.tasks.family import is_family_dir, load_family

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gateway_drift  # noqa: E402 -- the bench script, found on the path set above

RESULT = ROOT / "bench" / "results" / "gateway_drift.json"
FAMILIES = sorted(p.name for p in (ROOT / "tasks").iterdir() if is_family_dir(p))


def test_the_committed_result_has_no_mismatch_in_any_family_or_format():
    result = json.loads(RESULT.read_text())
    assert sorted(result["formats"]) == sorted(FORMATS) and sorted(result["families"]) == FAMILIES
    assert result["total"]["episodes"] == len(FORMATS) * len(FAMILIES)
    rows = [result["total"], *result["formats"].values(), *result["families"].values()]
    assert all(row["tito_mismatch_tokens"] == 0 for row in rows)
    assert result["total"]["naive"]["tokens_differ"] > 0, "the naive comparison measured nothing"
    with_format = sorted(name for name, fam in MODEL_FAMILIES.items() if fam.tool_format)
    assert sorted(result["model_families"]) == with_format
    assert all(row["tito_mismatch_tokens"] == 0 and row["episodes"] == len(FAMILIES)
               for row in result["model_families"].values())


def test_an_episode_on_qwen3s_own_template_has_no_mismatch():
    """Qwen3's template re-renders a turn sampled without reasoning once the conversation goes on (its empty
    think block goes): the gateway forks a segment instead of failing (it was a 500), and the mismatch check
    does not count the block the template writes into the last turn."""
    summary = gateway_drift.run_model_family("qwen3", [load_family(ROOT / "tasks" / "make-directory")], 8)
    assert summary["sampled_turns"] == 3 and summary["tito_mismatch_tokens"] == 0
    assert summary["history_rewrites"] == 2


@pytest.mark.parametrize("name", list(FORMATS))
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
