"""Did two `furlong train` runs of one config repeat each other? Episodes, step metrics, summary, weights.

    python bench/compare_runs.py RUN_A RUN_B [--out bench/results/NAME.json] [--runs 'how they were made']

Episodes are matched by (phase, step, task, group, attempt, sample) and compared by their response digest
(`response_sha`: the sampled token ids), reward and turns; the first differing one, in start order, is
named. Step metrics and the summary are compared without their timing fields; the final policies
(`hf_model`'s safetensors) tensor by tensor, to the bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import finish, provenance

TIMING = ("time", "second", "_s", "wait", "idle", "per_s", "throughput", "wall")


def _episodes(run: Path) -> dict[tuple, dict]:
    rows = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    return {(r["phase"], r["step"], r["task"], r["group"], r["attempt"], r["sample"]): r for r in rows}


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def compare(a: Path, b: Path) -> dict:
    ea, eb = _episodes(a), _episodes(b)
    same = lambda k: k in eb and all(ea[k][f] == eb[k][f] for f in ("response_sha", "reward", "turns"))
    differ = sorted((k for k in ea if not same(k)), key=lambda k: ea[k]["start"])
    ma = [_untimed(json.loads(line)) for line in (a / "metrics.jsonl").read_text().splitlines()]
    mb = [_untimed(json.loads(line)) for line in (b / "metrics.jsonl").read_text().splitlines()]
    metric_diffs = [{"step": x.get("step"), "phase": x.get("phase"),
                     "values": {k: [x[k], y.get(k)] for k in sorted(x) if x[k] != y.get(k)}}
                    for x, y in zip(ma, mb, strict=False) if x != y]
    sa, sb = (_untimed(json.loads((r / "summary.json").read_text())) for r in (a, b))
    sa.pop("run_dir"), sb.pop("run_dir")
    sa.pop("hf_model"), sb.pop("hf_model")
    return {"episodes": len(ea), "episodes_differing": len(differ),
            "first_differing": list(differ[0]) if differ else None,
            "metric_rows": len(ma), "metric_rows_differing": metric_diffs,
            "summary_equal": sa == sb, "weights_equal": _weights_equal(a, b)}


def _weights_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = (load_file(Path(json.loads((r / "summary.json").read_text())["hf_model"]) / "model.safetensors")
              for r in (a, b))
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs=2, type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", dest="how", default="", help="how the two runs were made (commit, command), recorded")
    args = ap.parse_args()
    prov = provenance()
    result = compare(*args.runs)
    result["config"] = (args.runs[0] / "config.yaml").read_text()
    result["runs_made_by"] = args.how
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**result, "provenance": finish(prov)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
