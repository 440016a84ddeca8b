"""The gateway's harness-facing routes (/v1/chat/completions, /v1/messages, /v1/models, /furlong/v1/exec)
fuzzed with schemathesis from tests/gateway_schema.py, against the run's gateway (furlong.gateway.local) on
the tiny model's hf engine, its exec route on a real sandbox: valid and invalid requests with an episode's
key, and requests without a valid key. No answer is a 5xx; without a valid key every answer is a 401; a
refused request changes no trajectory and runs no command; an episode nobody sends to records nothing.
Below it, a plain regression test for each 5xx (or refused-yet-recorded request) the fuzz found."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import spec
from gateway_schema import SCHEMA
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from furlong.engine.factory import make_engine
from furlong.envs.harbor import BashTools, GuardedSandbox
from furlong.gateway.build import make_policy
from furlong.gateway.exec import EpisodeTools
from furlong.gateway.local import LocalGateway
from furlong.gateway.sessions import Session

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Examples per route and mode with a key, and per route without one (refused before the body is read),
# derandomized so that CI sends the same requests each time: about 30 s on 2 loaded cores.
EXAMPLES, UNAUTHORIZED_EXAMPLES = 60, 5
COMMAND_TIMEOUT_S = 2.0  # the most a fuzzed command runs (the exec route's own limit)


class Served:
    """The run's gateway and an episode sandbox, in a loop of their own thread (schemathesis calls block)."""

    def __init__(self, tiny_dir, backend, base_image) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        engine = make_engine("hf", tiny_dir, seed=0)
        self.gateway = LocalGateway(make_policy(tiny_dir, engine, name="tiny", max_context=512, default_max_tokens=4))
        self.box = self.call(backend.create(spec(base_image)))
        self.url = self.call(self.gateway.start())
        self.tools = EpisodeTools(BashTools(GuardedSandbox(self.box)), COMMAND_TIMEOUT_S, 2000)
        self.key, self.session = self.gateway.mint(self.tools)
        self.bystander_key, self.bystander = self.gateway.mint(EpisodeTools(BashTools(GuardedSandbox(self.box)), 1, 100))
        ended_key, ended = self.gateway.mint(EpisodeTools(BashTools(GuardedSandbox(self.box)), 1, 100))
        self.call(self.gateway.end(ended.episode_id))
        self.answers: Counter[tuple[str, int]] = Counter()
        self.refused_keys = ["", "nope", f"{self.key}x", ended_key, "é-not-ascii"]

    def call(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def close(self) -> None:
        self.call(self.gateway.close())
        self.call(self.gateway.policy.engine.close())
        self.call(self.box.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def state(session: Session, tools: EpisodeTools) -> tuple:
    """What a request can change in an episode: its trajectory's counts and ids, and commands run."""
    t = session.trajectory
    return (t.requests, t.history_rewrites, t.malformed_calls, [(list(s.ids), list(s.mask)) for s in t.segments],
            tools.calls, session.ended)


def check(served: Served, case, key: str | None) -> None:
    if isinstance(case.body, dict) and type(case.body.get("timeout_s")) in (int, float):
        case.body["timeout_s"] = min(case.body["timeout_s"], COMMAND_TIMEOUT_S)
    headers = {} if key is None else {"Authorization": f"Bearer {key}".encode().decode("latin-1")}
    mine, bystander = state(served.session, served.tools), state(served.bystander, served.tools)
    r = case.call(base_url=served.url, headers=headers, timeout=120)
    served.answers[case.operation.label, r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code} {r.text[:500]}\n{case.as_curl_command()}"
    if key is None or key in served.refused_keys:
        assert r.status_code == 401, f"{r.status_code} without a valid key\n{case.as_curl_command()}"
    if r.status_code >= 400:
        assert state(served.session, served.tools) == mine, f"refused, yet recorded: {case.as_curl_command()}"
    assert served.bystander.trajectory.requests == 0 and state(served.bystander, served.tools)[:4] == bystander[:4]


def fuzz(served: Served, operation, mode: GenerationMode, keys: list[str | None], examples: int) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def one(case) -> None:
        for key in keys:
            check(served, case, key)

    one()


@pytest.fixture(scope="module")
def served(tiny_dir, backend, base_image):
    s = Served(tiny_dir, backend, base_image)
    yield s
    s.close()


def test_the_harness_routes_fuzzed_answer_no_5xx_and_refusals_record_nothing(served):
    operations = [result.ok() for result in schemathesis.openapi.from_dict(SCHEMA).get_all_operations()]
    assert sorted(op.label for op in operations) == ["GET /v1/models", "POST /furlong/v1/exec",
                                                     "POST /v1/chat/completions", "POST /v1/messages"]
    for op in operations:
        fuzz(served, op, GenerationMode.POSITIVE, [served.key], EXAMPLES)
        if op.body:
            fuzz(served, op, GenerationMode.NEGATIVE, [served.key], EXAMPLES)
        fuzz(served, op, GenerationMode.POSITIVE, [None, *served.refused_keys], UNAUTHORIZED_EXAMPLES)
    t = served.session.trajectory
    assert t.requests > 0 and t.segments and served.tools.calls > 0, "the fuzz never got a request through"
    assert all(served.answers[op.label, 200] for op in operations), f"a route never answered 200: {served.answers}"
    assert t.record_dict()["tito_mismatch_tokens"] == 0
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_a_conversation_too_long_for_the_context_is_refused_and_not_counted(served):
    """Found by the fuzz: the request was refused (400) but counted in the episode's `requests`."""
    key, session = served.gateway.mint(EpisodeTools(BashTools(GuardedSandbox(served.box)), 1, 100))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 600}]}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)
    assert r.status_code == 400 and "no room left" in r.json()["error"]["message"]
    assert session.trajectory.requests == 0 and session.trajectory.segments == []
    body["messages"][0]["content"] = "hi"
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)
    assert r.status_code == 200 and session.trajectory.record_dict()["requests"] == 1


def test_a_sampled_span_that_also_occurs_in_the_prompt_is_no_mismatch(served):
    """Found by the fuzz: the model sampled "sys" (cut by max_tokens), the mismatch check found it inside
    "<|im_start|>system" of the one-piece render, and counted the whole prompt as differing."""
    from furlong.engine.base import Generation
    from furlong.gateway.request import ChatRequest
    from furlong.model.chat import encode

    policy = served.gateway.policy
    traj = policy.trajectory()
    req = ChatRequest(messages=({"role": "system", "content": "x"}, {"role": "user", "content": ""}))
    traj.prompt(req.messages, req.tools)
    ids = encode(policy.tokenizer, "sys")
    policy._record(traj, req, Generation(tuple(ids), (0.0,) * len(ids), "length", 0), None, 5)
    assert traj.record_dict()["tito_mismatch_tokens"] == 0
