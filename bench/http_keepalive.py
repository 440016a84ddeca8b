"""Requests on a kept-alive connection to an engine server, with TCP_NODELAY on its accepted sockets (what
`furlong.sync.serving.bound_socket` gives since this bench) vs without (its socket made as it was before).

Each is a real engine server process (`python -m furlong.engine.server`, the tiny model); for the baseline
the process replaces `bound_socket` with the old one before serving. One httpx client per server sends
--requests GET /health over one connection, after one warm-up request, and the medians of their round
trips are compared. Without TCP_NODELAY a reply written in two parts (headers, then body) waits for the
client's delayed ACK.

    python bench/http_keepalive.py
    python bench/http_keepalive.py --requests 200 --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import finish, provenance

from furlong.engine.server import READY_PREFIX
from furlong.model import init_tiny

RESULTS = Path(__file__).parent / "results" / "http_keepalive.json"
ROOT = Path(__file__).resolve().parent.parent
OLD = """
import socket, sys
import furlong.engine.server as server

def old_socket(host, port):  # as bound_socket made it before: no protocol stated, Nagle's algorithm left on
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock

server.bound_socket = old_socket
sys.exit(server.main(sys.argv[1:]))
"""


def round_trips(model_dir: Path, baseline: bool, requests: int) -> list[float]:
    start = ["-c", OLD] if baseline else ["-m", "furlong.engine.server"]
    proc = subprocess.Popen([sys.executable, *start, "--model", str(model_dir), "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"the engine server did not start: {line!r}")
        with httpx.Client(base_url=line[len(READY_PREFIX):].strip(), trust_env=False) as client:
            client.get("/health").raise_for_status()  # connects: the rest reuse the connection
            out = []
            for _ in range(requests):
                began = time.perf_counter()
                client.get("/health").raise_for_status()
                out.append(time.perf_counter() - began)
            return out
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    model_dir = init_tiny(seed=0)
    runs = {"nodelay": round_trips(model_dir, False, args.requests),
            "before": round_trips(model_dir, True, args.requests)}
    medians = {k: statistics.median(v) for k, v in runs.items()}
    out = {"provenance": finish(prov), "requests": args.requests,
           "median_ms": {k: v * 1e3 for k, v in medians.items()},
           "p90_ms": {k: statistics.quantiles(v, n=10)[-1] * 1e3 for k, v in runs.items()},
           "ratio_nodelay_over_before": medians["nodelay"] / medians["before"]}
    print(f"median round trip: {out['median_ms']['nodelay']:.2f} ms with TCP_NODELAY, "
          f"{out['median_ms']['before']:.2f} ms before; ratio {out['ratio_nodelay_over_before']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
