"""The bundled oracle suite on one sandbox backend: every bundled task and family's oracle episodes through
`furlong eval --agent oracle`, with how many scored 1 and how many say their reward was integrity-checked.

    python bench/backend_oracle.py --backend gvisor [--out bench/results/backend_oracle_gvisor.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import finish, provenance

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gvisor")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "results" / f"backend_oracle_{args.backend}.json"
    prov = provenance()
    with tempfile.TemporaryDirectory() as tmp:
        episodes = Path(tmp) / "episodes.jsonl"
        cmd = [sys.executable, "-m", "furlong.cli", "eval", "--tasks", "tasks", "--agent", "oracle",
               "--concurrency", str(args.concurrency), "--out", str(episodes), f"sandbox.backend={args.backend}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"furlong eval failed ({proc.returncode}): {proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in episodes.read_text().splitlines() if line.strip()]
    res = {
        "provenance": finish(prov),
        "backend": args.backend,
        "episodes": len(rows),
        "reward_1": sum(r.get("reward") == 1.0 for r in rows),
        "status": dict(collections.Counter(r["status"] for r in rows)),
        "integrity_checked": {str(k).lower(): v for k, v in collections.Counter(r.get("integrity_checked") for r in rows).items()},
        "warned_at_build": "integrity_checked: false" in proc.stderr,
        "mean_seconds": {
            k: sum(r["timing"][k] for r in rows) / max(len(rows), 1) for k in ("sandbox_start", "agent_commands", "verifier")
        },
    }
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "provenance"}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
