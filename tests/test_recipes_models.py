"""recipes/models/: each real-checkpoint recipe loads, names its family's tool format and LoRA modules that exist
in the family's architecture, and agrees with its one-GPU plan (recipes/models/<family>.plan.yaml), whose figures
docs/models.md quotes from bench/results/recipe_plans.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from furlong.cluster.plan import GIB, make_plan
from furlong.cluster.shapes import kv_bytes_per_token
from furlong.cluster.spec import DTYPE_BYTES, load_spec
from furlong.config.load import load_config
from furlong.model.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "recipes" / "models"
RECIPES = sorted(p for p in MODELS.glob("*.yaml") if not p.name.endswith(".plan.yaml"))
PLANS = sorted(MODELS.glob("*.plan.yaml"))
RESULTS = ROOT / "bench" / "results" / "recipe_plans.json"
SPEC_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}  # a train config's dtype as the cluster spec names it


def _linear_names(family: str) -> set[str]:
    """The last name of every nn.Linear in the family's tiny variant: furlong's own config builder
    (furlong/model/families_configs.py), instantiated on the meta device (no weights, no tokenizer)."""
    config = FAMILIES[family].config(512, {"bos": 1, "eos": 2, "pad": 0})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}


def test_there_is_a_recipe_and_a_plan_per_family_named_for_it():
    assert len(RECIPES) >= 5
    for recipe in RECIPES:
        assert recipe.stem in FAMILIES, f"{recipe.name}: not a furlong family ({', '.join(FAMILIES)})"
        assert (MODELS / f"{recipe.stem}.plan.yaml").is_file(), f"{recipe.name} has no {recipe.stem}.plan.yaml"
    for plan in PLANS:  # a plan alone (a checkpoint furlong cannot load yet) says so
        family = plan.name.removesuffix(".plan.yaml")
        assert family in FAMILIES, f"{plan.name}: not a furlong family"
        assert (MODELS / f"{family}.yaml").is_file() or "No recipe goes with it" in plan.read_text(), plan.name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_with_its_familys_tool_format_and_real_lora_modules(recipe: Path):
    t = load_config(recipe).train
    fam = FAMILIES[recipe.stem]
    assert t.model.path is not None and t.model.path.is_absolute(), "a real checkpoint's directory, not the tiny model"
    assert t.agent.tool_format == fam.tool_format
    linears = _linear_names(recipe.stem)
    missing = [target for target in t.lora.targets if target not in linears]
    assert not missing, f"{recipe.name}: LoRA targets {missing} name no nn.Linear of {recipe.stem} ({sorted(linears)})"
    assert set(fam.lora_targets) <= set(t.lora.targets), "the family's own attention projections are adapted"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_and_its_plan_describe_the_same_run(recipe: Path):
    t = load_config(recipe).train
    spec = load_spec(MODELS / f"{recipe.stem}.plan.yaml")
    plan = make_plan(spec)
    assert spec.step is not None
    assert (spec.trainer.seq_len, spec.trainer.micro_batch) == (t.agent.max_context_tokens, t.rl.micro_batch_size)
    assert spec.trainer.lora_rank == (t.lora.rank if t.lora.enabled else 0)
    assert (spec.step.prompts, spec.step.group_size, spec.step.concurrent) == (
        t.rl.tasks_per_step,
        t.rl.group_size,
        t.rl.concurrency,
    )
    assert spec.rollout.engine == t.engine and t.device == "cuda" and (t.engine != "hf" or t.hf.device == "cuda")
    assert (spec.teacher is not None) == (t.rl.kl_coef > 0), "a KL reference is a frozen copy the plan must count"
    if spec.teacher is not None:  # the reference's bytes a parameter: train.model.frozen_dtype's
        assert spec.teacher.dtype == SPEC_DTYPE[t.model.frozen_dtype]
    if t.engine == "vllm":  # vLLM's share of the GPU and its weights' dtype: train.vllm's and train.sync's
        assert spec.rollout.memory_fraction == t.vllm.gpu_memory_utilization
        assert spec.rollout.dtype == SPEC_DTYPE[t.sync.engine_dtype]
    else:  # the hf engine loads the checkpoint in fp32 (furlong/build/links.py)
        assert spec.rollout.dtype == "fp32"
    fits = plan.trainer.fits and plan.engine.terms[0].bytes <= plan.engine.capacity
    assert fits == ("DOES NOT FIT" not in recipe.read_text()), "the recipe's header says what its plan says"
    if fits:  # every episode at the context limit at once still fits the engine's KV cache
        per_token = kv_bytes_per_token(spec.model, DTYPE_BYTES[spec.rollout.kv_dtype], 1, False)
        assert t.rl.concurrency * t.agent.max_context_tokens * per_token <= plan.engine.terms[1].bytes


def test_committed_plan_figures_are_the_plans_of_the_committed_specs():
    committed = json.loads(RESULTS.read_text())["plans"]
    assert sorted(committed) == [p.name.removesuffix(".plan.yaml") for p in PLANS]
    for family, row in committed.items():
        plan = make_plan(load_spec(ROOT / row["spec"]))
        assert row["params_b"] == plan.params.total / 1e9
        assert row["trainer_gib"] == pytest.approx(plan.trainer.total / GIB)
        assert row["engine_gib"] == pytest.approx(plan.engine.total / GIB)
        assert row["step_seconds"] == pytest.approx(plan.step.seconds if plan.step else None)
        assert row["problems"] == list(plan.problems), f"{family}: rerun python bench/recipe_plans.py"
