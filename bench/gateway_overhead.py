"""What the gateway adds to a request: the same generations through `/v1/chat/completions` (the real `openai`
SDK, the gateway on uvicorn in a thread) and called on an engine directly, at 1 and at 32 concurrent sessions.

Both arms run the tiny model on the hf engine (one engine each, the same weights), the same prompts and the
same per-request seeds, so both sample the same tokens (checked: the token counts must be equal). The arms
alternate, `--repeats` times, so a change of load on this shared machine hits both. Reported per
concurrency: p50 latency of a request in each arm, the added latency at p50, and the ratio of sampled tokens
per second (gateway / direct).

    python bench/gateway_overhead.py                 # ~1-3 min here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from host_support import serve_in_thread
from provenance import finish, provenance

from furlong.engine.base import SamplingParams
from furlong.engine.factory import make_engine
from furlong.gateway.app import make_app
from furlong.gateway.build import make_policy
from furlong.model import init_tiny
from furlong.model.chat import end_of_turn_id, render_prompt_ids

TOKEN = "gateway-bench-token-0123456789"


def _prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are an agent in a terminal."},
            {"role": "user", "content": f"Task {i}: list the files and print the largest one."}]


async def _direct(engine, tokenizer, stops, sessions: int, requests: int, tokens: int) -> tuple[list[float], int, float]:
    async def one(i: int) -> tuple[float, int]:
        t = time.perf_counter()
        gen = await engine.generate(render_prompt_ids(tokenizer, _prompt(i)),
                                    SamplingParams(max_new_tokens=tokens, stop_token_ids=stops, seed=i))
        return time.perf_counter() - t, gen.num_tokens
    return await _sessions(one, sessions, requests)


async def _gateway(url: str, sessions: int, requests: int, tokens: int) -> tuple[list[float], int, float]:
    """Each session is an episode with its own key, as a trainer runs them: its requests are recorded."""
    admin = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=600)
    keys = [(await admin.post("/episodes", cast_to=dict, body={}))["api_key"] for _ in range(sessions)]
    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0, timeout=600) for k in keys]

    async def one(i: int) -> tuple[float, int]:
        t = time.perf_counter()
        r = await clients[i // requests].chat.completions.create(model="tiny", messages=_prompt(i),
                                                                 max_tokens=tokens, seed=i)
        return time.perf_counter() - t, r.usage.completion_tokens
    try:
        return await _sessions(one, sessions, requests)
    finally:
        for c in (admin, *clients):
            await c.close()


async def _sessions(one, sessions: int, requests: int) -> tuple[list[float], int, float]:
    """`sessions` concurrent loops of `requests` requests each; latencies, sampled tokens, wall seconds."""
    async def loop(s: int) -> list[tuple[float, int]]:
        return [await one(s * requests + r) for r in range(requests)]
    t = time.perf_counter()
    done = await asyncio.gather(*(loop(s) for s in range(sessions)))
    wall = time.perf_counter() - t
    flat = [x for session in done for x in session]
    return [lat for lat, _ in flat], sum(n for _, n in flat), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--requests", type=int, default=8, help="requests per session (default 8)")
    ap.add_argument("--tokens", type=int, default=16, help="max tokens per request (default 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gateway_overhead.json"))
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    model_dir = init_tiny()
    gw_engine, direct_engine = make_engine("hf", model_dir, seed=0), make_engine("hf", model_dir, seed=0)
    policy = make_policy(model_dir, gw_engine, name="tiny", max_context=1024, default_max_tokens=args.tokens)
    server, thread, url = serve_in_thread(make_app(policy, TOKEN))
    stops = tuple(end_of_turn_id(policy.tokenizer, m) for m in policy.fmt.stops)
    results = {}
    loop = asyncio.new_event_loop()
    for c in (int(x) for x in args.concurrency.split(",")):
        arms: dict[str, dict[str, list[float]]] = {"direct": {"lat": [], "tps": []}, "gateway": {"lat": [], "tps": []}}
        counts = {"direct": 0, "gateway": 0}
        for _ in range(args.repeats):
            for name in ("direct", "gateway"):
                run = (_direct(direct_engine, policy.tokenizer, stops, c, args.requests, args.tokens)
                       if name == "direct" else _gateway(url, c, args.requests, args.tokens))
                lats, n, wall = loop.run_until_complete(run)
                arms[name]["lat"] += lats
                arms[name]["tps"].append(n / wall)
                counts[name] += n
        if counts["direct"] != counts["gateway"]:
            raise SystemExit(f"concurrency {c}: the arms sampled different token counts {counts}")
        p50 = {k: statistics.median(v["lat"]) for k, v in arms.items()}
        tps = {k: statistics.median(v["tps"]) for k, v in arms.items()}
        results[str(c)] = {"p50_ms": {k: round(v * 1e3, 2) for k, v in p50.items()},
                           "added_p50_ms": round((p50["gateway"] - p50["direct"]) * 1e3, 2),
                           "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
                           "tokens_per_s_ratio": round(tps["gateway"] / tps["direct"], 3),
                           "requests_per_arm": c * args.requests * args.repeats, "sampled_tokens": counts["direct"]}
        print(f"{c:>3} sessions: p50 direct {p50['direct'] * 1e3:.1f} ms, gateway {p50['gateway'] * 1e3:.1f} ms "
              f"(+{results[str(c)]['added_p50_ms']} ms); tokens/s ratio {results[str(c)]['tokens_per_s_ratio']}")
    loop.run_until_complete(direct_engine.close())
    server.should_exit = True
    thread.join(30)
    out = {"provenance": finish(prov), "settings": vars(args) | {"out": str(args.out)}, "concurrency": results}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
