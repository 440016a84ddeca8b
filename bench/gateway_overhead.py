"""What the gateway adds to a request: the same agent episodes through the gateway's `/v1/chat/completions`
and sent to the engine's own HTTP API (`furlong engine serve`'s `/generate`, token ids in and out), at 1 and
at 32 concurrent sessions, from a client in a process of its own.

One server process (`--serve`, started by this script) holds two hf engines on the tiny model (the same
weights and seed: one per arm, so neither arm warms the other's prefix cache), the gateway app over one and
the engine app over the other, each on its own loopback port under uvicorn as `furlong gateway serve` runs
it. This process is the client, one `httpx` client per session in both arms. A session is an episode of
`--requests` turns: each turn's answer and a terminal's output are appended and the next turn sampled. The
gateway arm sends the whole conversation every turn under the episode's key (recorded, as a trainer runs a
harness); the direct arm keeps the episode as token ids, as a TITO trainer's own loop does (the prompt's and
observations' ids rendered before timing: rendering is the gateway's work, counted in it). Both arms use the
same per-request seeds, so they sample the same tokens: checked, the token counts must be equal, and each
gateway episode of the first repeat must have recorded exactly the direct episode's ids. The arms
alternate, `--repeats` times, so a change of load hits both.

Reported per concurrency: p50 latency in each arm, the added latency at p50 (and mean), the ratio of sampled
tokens per second (gateway / direct); where the gateway's time goes, each phase's mean from its
`Server-Timing` header (furlong.gateway.timing); and CPU per request of the server process, its event-loop
thread and the client, per arm, from /proc (robust to this shared machine's load, where latency is not).
`--profile FILE` also writes a cProfile of the server process's main thread (pstats) and prints its top.

    python bench/gateway_overhead.py                 # ~2-3 min here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpuload import _cpu_ticks
from provenance import finish, provenance

from furlong.gateway.timing import PHASES, parse_header

TOKEN = "gateway-bench-token-0123456789"
READY = "gateway-bench ready "
Row = tuple[float, int, dict[str, float]]  # a request's latency (s), sampled tokens, gateway phases (ms)


class Arm(NamedTuple):
    """One arm's run at one concurrency."""

    latencies: list[float]
    tokens: int
    wall: float
    phases: list[dict[str, float]]  # per request, from Server-Timing (the gateway's phases, both arms' `app`)
    ends: list[Any]  # per session: the direct arm's final ids, the gateway arm's episode id


def _prompt(s: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are an agent in a terminal."},
            {"role": "user", "content": f"Task {s}: list the files and print the largest one."}]


def _observation(s: int, k: int) -> dict[str, str]:
    """What the harness sends back after session `s`'s turn `k`: a terminal's output, as a user turn."""
    rows = "\n".join(f"-rw-r--r-- 1 agent agent {1000 * (j + 1) + s} Dec  7 19:{k:02d} file_{s}_{k}_{j}.txt"
                     for j in range(2))
    return {"role": "user", "content": f"$ ls -la\ntotal {2 * (k + 1)}\n{rows}"}


# ---- the server process ---------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> None:
    """Both apps on loopback in this process's one event loop until SIGTERM; what the direct arm's client
    sends (each session's prompt ids, each observation's ids after a turn) written to `args.serve`, then the
    ready line with both URLs."""
    import torch

    torch.set_num_threads(1)
    from furlong.engine.factory import make_engine
    from furlong.engine.server import build_app
    from furlong.gateway.app import make_app
    from furlong.gateway.build import make_policy
    from furlong.model import init_tiny
    from furlong.model.chat import continuation_ids, end_of_turn_id, render_prompt_ids

    model_dir = init_tiny()
    gw_engine, direct_engine = make_engine("hf", model_dir, seed=0), make_engine("hf", model_dir, seed=0)
    policy = make_policy(model_dir, gw_engine, name="tiny", max_context=8192, default_max_tokens=args.tokens)
    tok, eot = policy.tokenizer, policy.fmt.turn_ends
    # an append-only template (the tiny model's ChatML) writes the same ids after any history: what a TITO
    # caller of the engine appends after each sampled turn
    after = [[continuation_ids(tok, [_observation(s, k)], end_of_turn=eot) for k in range(args.requests)]
             for s in range(args.sessions)]
    Path(args.serve).write_text(json.dumps({
        "stops": [end_of_turn_id(tok, m) for m in policy.fmt.stops], "end_of_turn": end_of_turn_id(tok, eot),
        "prompt": [render_prompt_ids(tok, _prompt(s)) for s in range(args.sessions)], "after": after}))
    apps = {"gateway": make_app(policy, TOKEN, server_timing=True), "direct": build_app(direct_engine, None, TOKEN)}
    _run_servers({k: _timed(app) for k, app in apps.items()}, args.profile)


def _timed(app):
    """`app` with a `Server-Timing: app;dur=MS` header of its own: from the request reaching the app to its
    answer starting, measured the same way in both arms (routing, body, handler)."""
    async def timed(scope, receive, send):
        start = time.perf_counter()

        async def send_timed(message):
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - start) * 1e3
                timing = (b"server-timing", f"app;dur={ms:.3f}".encode())
                message = message | {"headers": [*message.get("headers", []), timing]}
            await send(message)
        await app(scope, receive, send_timed if scope["type"] == "http" else send)
    return timed


def _run_servers(apps: dict, profile: str | None) -> None:
    import cProfile
    import socket

    import uvicorn

    from furlong.gateway.serving import gateway_config

    class Server(uvicorn.Server):
        def install_signal_handlers(self) -> None:  # this script stops both servers on SIGTERM
            pass

        def capture_signals(self):  # uvicorn >= 0.29 names it so
            import contextlib
            return contextlib.nullcontext()

    async def main() -> None:
        servers, urls, tasks = [], {}, []
        for name, app in apps.items():
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            server = Server(gateway_config(app))
            servers.append(server)
            urls[name] = f"http://127.0.0.1:{sock.getsockname()[1]}"
            tasks.append(asyncio.ensure_future(server.serve(sockets=[sock])))
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, lambda: [setattr(s, "should_exit", True) for s in servers])
        while not all(s.started for s in servers):
            await asyncio.sleep(0.02)
        print(READY + json.dumps(urls), flush=True)
        await asyncio.gather(*tasks)

    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    factory = gateway_config(apps["gateway"]).get_loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)


# ---- the client (this process) --------------------------------------------------------------------------


async def _direct(url: str, ids: dict, sessions: int, turns: int, tokens: int):
    """Each session an episode kept as token ids, as a TITO trainer's own agent loop keeps it: the sampled
    ids, the end-of-turn id where a turn was cut off, the observation's ids."""
    async def episode(s: int, client: httpx.AsyncClient) -> tuple[list[Row], list[int]]:
        prompt, out = list(ids["prompt"][s]), []
        for k in range(turns):
            body = {"input_ids": prompt,
                    "sampling": {"max_new_tokens": tokens, "stop_token_ids": ids["stops"], "seed": s * turns + k}}
            t = time.perf_counter()
            r = await client.post("/generate", json=body)
            lat = time.perf_counter() - t
            r.raise_for_status()
            gen = r.json()
            prompt += gen["output_ids"] + ([ids["end_of_turn"]] if gen["finish_reason"] == "length" else [])
            prompt += ids["after"][s][k]
            out.append((lat, len(gen["output_ids"]), parse_header(r.headers["server-timing"])))
        return out, prompt
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return await _sessions(episode, lambda s: httpx.AsyncClient(base_url=url, headers=headers, timeout=600),
                           sessions)


async def _gateway(url: str, sessions: int, turns: int, tokens: int):
    """Each session an episode with its own key, as a trainer runs a harness: the whole conversation
    resent with every request, the answer appended as returned, then the observation."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
        minted = [(await admin.post("/v1/episodes", json={})).json() for _ in range(sessions)]

    async def episode(s: int, client: httpx.AsyncClient) -> tuple[list[Row], str]:
        messages, out = _prompt(s), []
        for k in range(turns):
            body = {"model": "tiny", "messages": messages, "max_tokens": tokens, "seed": s * turns + k}
            t = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            lat = time.perf_counter() - t
            r.raise_for_status()
            answer = r.json()
            messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""},
                         _observation(s, k)]
            out.append((lat, answer["usage"]["completion_tokens"], parse_header(r.headers["server-timing"])))
        return out, minted[s]["episode_id"]
    return await _sessions(episode, lambda s: httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {minted[s]['api_key']}"}, timeout=600), sessions)


async def _sessions(episode, client, sessions: int) -> Arm:
    """`sessions` concurrent episodes, each on its own `client(s)`."""
    async def run(s: int):
        async with client(s) as c:
            return await episode(s, c)
    t = time.perf_counter()
    done = await asyncio.gather(*(run(s) for s in range(sessions)))
    wall = time.perf_counter() - t
    flat = [x for rows, _ in done for x in rows]
    return Arm([lat for lat, _, _ in flat], sum(n for _, n, _ in flat), wall, [p for _, _, p in flat],
               [end for _, end in done])


def _summary(arms: dict, counts: dict, phases: dict[str, list[dict[str, float]]], c: int, args) -> dict:
    p50 = {k: statistics.median(v["lat"]) for k, v in arms.items()}
    mean = {k: statistics.fmean(v["lat"]) for k, v in arms.items()}
    tps = {k: statistics.median(v["tps"]) for k, v in arms.items()}
    phase_ms = {p: round(statistics.fmean(r.get(p, 0.0) for r in phases["gateway"]), 3) for p in PHASES}
    app_ms = {k: statistics.fmean(r["app"] for r in v) for k, v in phases.items()}
    work = [p for p in PHASES if p not in ("receive", "queue", "engine")]
    cpu_ms = {p: round(statistics.fmean(r.get(f"{p}-cpu", 0.0) for r in phases["gateway"]), 3) for p in work}
    handler_ms = sum(phase_ms[p] for p in work)
    added_mean_ms = (mean["gateway"] - mean["direct"]) * 1e3
    per_request = 1e3 / os.sysconf("SC_CLK_TCK") / (c * args.requests * args.repeats)
    cpu = {where: {k: round(sum(t[i] for t in v["cpu"]) * per_request, 2) for k, v in arms.items()}
           for i, where in enumerate(("server", "server_event_loop", "client"))}
    return {"p50_ms": {k: round(v * 1e3, 2) for k, v in p50.items()},
            "added_p50_ms": round((p50["gateway"] - p50["direct"]) * 1e3, 2),
            "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
            "tokens_per_s_ratio": round(tps["gateway"] / tps["direct"], 3),
            "requests_per_arm": c * args.requests * args.repeats, "sampled_tokens": counts["direct"],
            "mean_ms": {k: round(v * 1e3, 2) for k, v in mean.items()},
            "added_mean_ms": round(added_mean_ms, 2),
            # the gateway's handler, phase by phase (mean ms per request); `engine` is the sampling itself,
            # `receive` waiting for the body's bytes and the event loop
            "gateway_phases_mean_ms": phase_ms,
            # from the request reaching the app to its answer starting, and the rest of the client's latency
            # (HTTP both ways, waits to be scheduled on this shared machine, the client's own work)
            "server_app_mean_ms": {k: round(v, 2) for k, v in app_ms.items()},
            "outside_app_mean_ms": {k: round(mean[k] * 1e3 - v, 2) for k, v in app_ms.items()},
            # its own work: parse, render, decode, record, serialize
            "gateway_work_ms": round(handler_ms, 3),
            # the added mean latency that work does not explain: HTTP and routing, waits for the event loop,
            # the engine slowed by the gateway's CPU beside it, the client's work on the larger answer
            "added_beyond_gateway_work_ms": round(added_mean_ms - handler_ms, 2),
            # the same work as the event loop thread's CPU time (no waits to be scheduled in it): robust to load
            "gateway_work_cpu_phases_mean_ms": cpu_ms,
            "gateway_work_cpu_ms": round(sum(cpu_ms.values()), 3),
            # CPU per request (ms; sampled at the kernel's tick): robust to the machine's load where latency is
            # not. The server's whole process (engine threads included), its event loop thread, the client
            "cpu_ms_per_request": cpu,
            "server_cpu_ratio": round(cpu["server"]["gateway"] / cpu["server"]["direct"], 3)}


def _ticks(pid: int) -> tuple[int, int, int]:
    """CPU ticks so far: the server process, its main thread (the event loop), this client process."""
    proc = Path(f"/proc/{pid}")
    mine = os.times()
    return (_cpu_ticks(proc / "stat"), _cpu_ticks(proc / "task" / str(pid) / "stat"),
            round((mine.user + mine.system) * os.sysconf("SC_CLK_TCK")))


def _exact(url: str, arm: Arm, direct: Arm) -> None:
    """Each gateway episode recorded exactly the ids the direct arm's episode sent and sampled: one segment,
    no mismatch, the same ids through its last sampled turn."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as admin:
        for episode_id, ids in zip(arm.ends, direct.ends, strict=True):
            record = admin.get(f"/v1/episodes/{episode_id}").json()
            got = record["segments"][0]["ids"]
            if len(record["segments"]) != 1 or record["tito_mismatch_tokens"] or got != ids[: len(got)]:
                raise SystemExit(f"episode {episode_id}: the gateway recorded other ids than the direct arm's")


def _measure(urls: dict, ids: dict, c: int, args, pid: int) -> dict:
    arms: dict[str, dict[str, list[float]]] = {k: {"lat": [], "tps": [], "cpu": []} for k in ("direct", "gateway")}
    counts, phases = {"direct": 0, "gateway": 0}, {"direct": [], "gateway": []}
    for repeat in range(args.repeats):
        runs: dict[str, Arm] = {}
        for name in ("direct", "gateway"):
            run = (_direct(urls["direct"], ids, c, args.requests, args.tokens) if name == "direct"
                   else _gateway(urls["gateway"], c, args.requests, args.tokens))
            before = _ticks(pid)
            runs[name] = arm = asyncio.run(run)
            arms[name]["cpu"].append([b - a for a, b in zip(before, _ticks(pid), strict=True)])
            arms[name]["lat"] += arm.latencies
            arms[name]["tps"].append(arm.tokens / arm.wall)
            counts[name] += arm.tokens
            phases[name] += arm.phases
        if repeat == 0:
            _exact(urls["gateway"], runs["gateway"], runs["direct"])
    if counts["direct"] != counts["gateway"]:
        raise SystemExit(f"concurrency {c}: the arms sampled different token counts {counts}")
    return _summary(arms, counts, phases, c, args)


def _start_server(args, prompts_file: str) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, __file__, "--serve", prompts_file, "--tokens", str(args.tokens),
           "--requests", str(args.requests), "--sessions", str(max(int(x) for x in args.concurrency.split(",")))]
    cmd += ["--profile", str(args.profile)] if args.profile else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(READY):
            return proc, json.loads(line[len(READY):])
    raise SystemExit(f"the server process exited ({proc.wait()}) before it listened")


def _print_profile(path: Path) -> None:
    import pstats

    pstats.Stats(str(path)).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--requests", type=int, default=8, help="requests (turns) per session's episode (default 8)")
    ap.add_argument("--tokens", type=int, default=16, help="max tokens per request (default 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gateway_overhead.json"))
    ap.add_argument("--profile", type=Path, help="write a cProfile of the server process here (pstats)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # the server process: where to write the prompts' ids
    ap.add_argument("--sessions", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return _serve(args)
    prov = provenance()
    with tempfile.TemporaryDirectory() as tmp:
        proc, urls = _start_server(args, os.path.join(tmp, "prompts.json"))
        try:
            ids = json.loads(Path(tmp, "prompts.json").read_text())
            # untimed: the first forwards, connections and imports of each arm
            asyncio.run(_direct(urls["direct"], ids, 1, 2, args.tokens))
            asyncio.run(_gateway(urls["gateway"], 1, 2, args.tokens))
            results = {}
            for c in (int(x) for x in args.concurrency.split(",")):
                results[str(c)] = r = _measure(urls, ids, c, args, proc.pid)
                print(f"{c:>3} sessions: p50 direct {r['p50_ms']['direct']} ms, gateway {r['p50_ms']['gateway']} ms "
                      f"(+{r['added_p50_ms']} ms); tokens/s ratio {r['tokens_per_s_ratio']}; "
                      f"app {r['server_app_mean_ms']}, outside it {r['outside_app_mean_ms']}; "
                      f"phases {r['gateway_phases_mean_ms']}; work cpu {r['gateway_work_cpu_phases_mean_ms']}; "
                      f"cpu {r['cpu_ms_per_request']}", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if args.profile:
        _print_profile(args.profile)
    out = {"provenance": finish(prov), "settings": vars(args) | {"out": str(args.out), "profile": None},
           "concurrency": results}
    for k in ("serve", "sessions"):
        out["settings"].pop(k)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
