"""`furlong train --plan` for every real-checkpoint cluster spec, recipes/models/*.plan.yaml (docs/models.md,
"Recipes for real checkpoints"): each family's parameter count, what the trainer and the engine hold on the
one GPU, whether it fits, and the step-time estimate, with the plan's printed output, into one JSON.

    python bench/recipe_plans.py [--out bench/results/recipe_plans.json]

A dry run (no GPU, no model loaded): the numbers are the plan's formulas over the published config.json shapes,
not measurements.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import finish, provenance  # noqa: E402
from rich.console import Console  # noqa: E402

from furlong.cluster.plan import GIB, Plan, make_plan  # noqa: E402
from furlong.cluster.show import print_plan  # noqa: E402
from furlong.cluster.spec import load_spec  # noqa: E402

SPECS = ROOT / "recipes" / "models"


def summary(plan: Plan) -> dict:
    """The figures docs/models.md's table quotes. Colocated, the trainer and the engine share each GPU, so the
    GPU holds both totals plus the trainer's reserved_gib."""
    s = plan.spec
    trainer, engine = plan.trainer.total / GIB, plan.engine.total / GIB
    gpu = (trainer + engine if s.colocate else max(trainer, engine)) + s.trainer.reserved_gib
    # the input embedding and lm_head, which model cards leave out of their "non-embedding" counts
    embeddings = plan.params.embedding + plan.params.head - s.model.hidden
    return {
        "model": s.model.name,
        "params_b": plan.params.total / 1e9,
        "active_b": plan.params.active / 1e9,
        "params_without_embeddings_b": (plan.params.total - embeddings) / 1e9,
        "active_without_embeddings_b": (plan.params.active - embeddings) / 1e9,
        "gpus": s.trainer.gpus if s.colocate else s.trainer.gpus + s.rollout.gpus,
        "gpu_memory_gib": next(g for g in s.nodes if g.gpus).gpu_memory_gib,
        "lora_rank": s.trainer.lora_rank,
        "trainer_gib": trainer,
        "engine_gib": engine,
        "per_gpu_gib": gpu,
        "fits": plan.trainer.fits and plan.engine.terms[0].bytes <= plan.engine.capacity,
        "step_seconds": plan.step.seconds if plan.step else None,
        "problems": list(plan.problems),
    }


def printed(plan: Plan) -> str:
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=160, no_color=True, highlight=False))
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/recipe_plans.json")
    args = parser.parse_args()
    prov = provenance()
    plans = {}
    for path in sorted(SPECS.glob("*.plan.yaml")):
        plan = make_plan(load_spec(path))
        family = path.name.removesuffix(".plan.yaml")
        plans[family] = {"spec": str(path.relative_to(ROOT)), **summary(plan), "output": printed(plan)}
        row = plans[family]
        print(
            f"{family}: {row['model']} {row['params_b']:.2f}B, {row['per_gpu_gib']:.1f} GiB a GPU, fits {row['fits']}"
        )
    args.out.write_text(json.dumps({"provenance": finish(prov), "plans": plans}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
