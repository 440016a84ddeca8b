"""The gateway, driven by the real `openai` and `anthropic` SDKs against the real app on uvicorn, with the
tiny model on the hf engine: multi-turn trajectories without re-tokenization, logprobs equal to the engine's,
episode keys, streaming, and the refusals (each of which leaves every trajectory unchanged)."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest
from host_support import serve_in_thread

from furlong.engine.base import SamplingParams
from furlong.engine.factory import make_engine
from furlong.gateway.app import make_app
from furlong.gateway.build import make_policy
from furlong.model.chat import render_prompt_ids

TOKEN = "gateway-test-token-0123456789"
SYSTEM = {"role": "system", "content": "You are terse."}
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}


class Gateway:
    def __init__(self, model_dir):
        self.engine = make_engine("hf", model_dir, seed=0)
        self.policy = make_policy(model_dir, self.engine, name="tiny", max_context=1024, default_max_tokens=12)
        self.app = make_app(self.policy, TOKEN, max_body_bytes=1 << 20)
        self.server, self.thread, self.url = serve_in_thread(self.app)
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    def episode(self) -> tuple[str, str]:
        r = self.admin.post("/v1/episodes", json={})
        assert r.status_code == 201, r.text
        return r.json()["episode_id"], r.json()["api_key"]

    def record(self, episode_id: str) -> dict:
        r = self.admin.get(f"/v1/episodes/{episode_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def gw(tiny_dir):
    g = Gateway(tiny_dir)
    yield g
    g.server.should_exit = True
    g.thread.join(30)


def test_two_turns_are_one_trajectory_with_the_sampled_ids(gw):
    """The second request resends the first turn as returned: its ids are reused, only the new user message is
    rendered; the mask covers exactly the sampled tokens, whose logprobs are the ones the client got."""
    eid, key = gw.episode()
    client = gw.openai(key)
    messages = [SYSTEM, {"role": "user", "content": "list the files"}]
    first = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, seed=3, max_tokens=8)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "and now?"})
    second = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, seed=4, max_tokens=8)
    rec = gw.record(eid)
    assert rec["requests"] == 2 and rec["gateway_history_rewrites"] == 0 and len(rec["segments"]) == 1
    seg = rec["segments"][0]
    prompt = render_prompt_ids(gw.policy.tokenizer, messages[:2])
    assert seg["ids"][:len(prompt)] == prompt
    sampled = [lp for lp, m in zip(seg["logprobs"], seg["mask"], strict=True) if m]
    returned = [t.logprob for r in (first, second) for t in r.choices[0].logprobs.content]
    assert sum(seg["mask"]) == first.usage.completion_tokens + second.usage.completion_tokens == len(returned)
    assert sampled == pytest.approx(returned, abs=1e-6)
    assert [e - s for s, e in seg["turns"]] == [first.usage.completion_tokens, second.usage.completion_tokens]
    assert second.usage.prompt_tokens == seg["turns"][1][0]  # the second prompt is everything stored before it
    assert rec["tito_mismatch_tokens"] == 0


def test_the_sampled_tokens_are_the_engines(gw, tiny_dir):
    """Same prompt ids, same seed on a second engine over the same weights: the same ids and logprobs as the
    gateway recorded (the gateway adds nothing to what is sampled)."""
    eid, key = gw.episode()
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    gw.openai(key).chat.completions.create(model="tiny", messages=messages, seed=11, max_tokens=10)
    seg = gw.record(eid)["segments"][0]
    prompt = render_prompt_ids(gw.policy.tokenizer, messages)
    engine = make_engine("hf", tiny_dir, seed=0)
    stops = tuple(gw.policy.tokenizer.convert_tokens_to_ids(m) for m in gw.policy.fmt.stops)

    async def direct():
        try:
            return await engine.generate(prompt, SamplingParams(max_new_tokens=10, stop_token_ids=stops, seed=11))
        finally:
            await engine.close()

    gen = asyncio.run(direct())
    start, end = seg["turns"][0]
    assert tuple(seg["ids"][start:end]) == gen.output_ids
    assert seg["logprobs"][start:end] == pytest.approx(list(gen.logprobs), abs=1e-6)


def test_an_edited_history_starts_a_new_segment(gw):
    eid, key = gw.episode()
    client = gw.openai(key)
    first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=4)
    edited = [{"role": "user", "content": "a, summarised"}, first.choices[0].message.model_dump(exclude_none=True),
              {"role": "user", "content": "b"}]
    client.chat.completions.create(model="tiny", messages=edited, max_tokens=4)
    rec = gw.record(eid)
    assert rec["gateway_history_rewrites"] == 1 and len(rec["segments"]) == 2
    assert rec["tito_mismatch_tokens"] == 0


def test_streaming_gives_the_turn_and_a_final_usage_chunk(gw):
    eid, key = gw.episode()
    stream = gw.openai(key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == sum(gw.record(eid)["segments"][0]["mask"])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_anthropic_messages_with_a_tool_round_trip(gw):
    """system, a tool_use the assistant made and its tool_result: rendered as the template's tool turn; the
    reply is a message the SDK reads; streaming gives the same kind of message."""
    eid, key = gw.episode()
    client = anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "what is here?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash",
                                                   "input": {"cmd": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]}]
    tools = [{"name": "bash", "description": "run a command", "input_schema": BASH["function"]["parameters"]}]
    msg = client.messages.create(model="tiny", system="be brief", messages=messages, tools=tools, max_tokens=8)
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert msg.usage.output_tokens == sum(gw.record(eid)["segments"][0]["mask"])
    with client.messages.stream(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens >= 1
    rec = gw.record(eid)
    assert rec["gateway_history_rewrites"] == 1 and rec["tito_mismatch_tokens"] == 0


def test_a_tool_call_the_model_writes_is_parsed_and_a_malformed_one_is_text(gw):
    """The model's text through the tool-call format: a well-formed call is an OpenAI tool call (its id answered by
    the next tool message), a malformed one comes back as plain content and is counted."""
    from furlong.engine.base import Generation
    from furlong.gateway.request import ChatRequest
    from furlong.model.chat import encode

    tok, policy = gw.policy.tokenizer, gw.policy
    traj = policy.trajectory()
    req = ChatRequest(messages=({"role": "user", "content": "go"},), tools=(BASH,))
    for text, calls in (('<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>', 1),
                        ('<tool_call>\n{"name": "bash", "argu<|im_end|>', 0)):
        traj.prompt(req.messages, req.tools)
        ids = encode(tok, text)
        reply = policy._record(traj, req, Generation(tuple(ids), (0.0,) * len(ids), "stop", 0), None, 5)
        assert len(reply.tool_calls) == calls and reply.malformed_call == (calls == 0)
    assert reply.content.startswith("<tool_call>") and traj.malformed_calls == 1


def test_refusals_change_nothing(gw):
    """No key, a bad key, bad JSON, wrong types, unknown roles, n > 1, images, top_logprobs, a tool result for a
    call never made, a body over the limit: each a 4xx naming what is wrong; the episode's trajectory is
    untouched; a key is refused once its episode ended."""
    eid, key = gw.episode()
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    bad = [({}, ok, 401), ({"Authorization": "Bearer nope"}, ok, 401),
           ({"Authorization": "Bearer é-not-ascii".encode()}, ok, 401),
           (None, b"{not json", 400), (None, [1, 2], 400), (None, {**ok, "messages": "hi"}, 400),
           (None, {**ok, "messages": [{"role": "wizard", "content": "x"}]}, 400), (None, {**ok, "n": 2}, 400),
           (None, {**ok, "top_logprobs": 3}, 400), (None, {**ok, "temperature": "hot"}, 400),
           (None, {**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
           (None, {**ok, "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "out"}]}, 400),
           (None, {**ok, "messages": [{"role": "user", "content": "y" * (2 << 20)}]}, 413)]
    for headers, body, status in bad:
        headers = {"Authorization": f"Bearer {key}"} if headers is None else headers
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=60, **kw)
        assert r.status_code == status, (body if isinstance(body, bytes) else str(body)[:120], r.text)
        assert r.json()["error"]["message"]
    assert gw.record(eid)["requests"] == 0 and gw.record(eid)["segments"] == []
    with pytest.raises(openai.BadRequestError, match="n: not supported"):
        gw.openai(key).chat.completions.create(model="tiny", messages=ok["messages"], n=2)
    assert gw.admin.post(f"/v1/episodes/{eid}/end").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        gw.openai(key).chat.completions.create(model="tiny", messages=ok["messages"], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):  # an episode key cannot mint or read episodes
        gw.openai(gw.episode()[1]).post("/episodes", cast_to=dict, body={})
    assert httpx.get(f"{gw.url}/health").status_code == 200
    assert httpx.get(f"{gw.url}/openapi.json").status_code == 404


def test_models_lists_the_served_model(gw):
    assert [m.id for m in gw.openai(TOKEN).models.list()] == ["tiny"]


def test_the_mismatch_count_sees_ids_a_full_render_would_not_give(gw):
    """tito_mismatch_tokens is an independent check: stored ids that differ from the one-piece render of the
    conversation (here: a rendered token changed after the fact) are counted; sampled tokens are never blamed."""
    eid, key = gw.episode()
    client = gw.openai(key)
    messages = [{"role": "user", "content": "one"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "two"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    seg = gw.app.state.sessions.get(eid).trajectory.segments[0]
    at = seg.turns[1][0] - 2  # inside the rendered second user turn
    seg.ids[at] = (seg.ids[at] + 1) % len(gw.policy.tokenizer)
    assert gw.record(eid)["tito_mismatch_tokens"] >= 1


def test_serve_refuses_a_network_bind_without_a_token_file(tiny_dir):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "furlong.cli", "gateway", "serve", "--model", str(tiny_dir),
                        "--host", "0.0.0.0"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--token-file" in r.stdout + r.stderr
