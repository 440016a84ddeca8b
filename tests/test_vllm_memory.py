"""train.vllm: the memory vLLM takes reaches its engine args (no engine started: building the args is the
seam), and `furlong train --plan`'s rollout.memory_fraction, the same fraction, moves the plan's numbers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import skips

from furlong.build.cluster import _engine_spec
from furlong.cluster.plan import GIB, make_plan
from furlong.cluster.spec import load_spec
from furlong.config.load import ConfigError, load_config
from furlong.engine.vllm import vllm_available

ROOT = Path(__file__).resolve().parent.parent
needs_vllm = skips.skipif("extra:vllm", not vllm_available(), "vLLM is not installed (bash install.sh --vllm)")


def _train(tmp_path: Path, vllm: str):
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  engine: vllm\n  vllm: {vllm}\n")
    return load_config(path).train


@needs_vllm
def test_gpu_memory_utilization_reaches_vllms_engine_args(tiny_dir: Path, tmp_path: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from furlong.engine.vllm import _engine_args

    t = _train(tmp_path, "{gpu_memory_utilization: 0.35, kv_cache_gib: 2}")
    args = _engine_args(tiny_dir, "float32", 0, 256, None, t.vllm.gpu_memory_utilization)
    assert args.gpu_memory_utilization == 0.35
    default = _engine_args(tiny_dir, "float32", 0, 256, None, None)
    assert default.gpu_memory_utilization == AsyncEngineArgs.gpu_memory_utilization  # null: vLLM's own default
    # on Ray each vLLM engine actor builds its engine from the spec the driver sends it
    assert _engine_spec(load_config(tmp_path / "c.yaml"), tiny_dir, None, None, "tok", False).vllm == t.vllm


@needs_vllm
def test_kv_cache_gib_sets_the_cpu_builds_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from furlong.engine.vllm import cpu_environment

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu_environment(None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # furlong's small default
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    cpu_environment(None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the user's own setting is kept
    cpu_environment(2)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"  # train.vllm.kv_cache_gib wins


def test_bad_fractions_are_refused_naming_the_key(tmp_path: Path) -> None:
    for bad in ("{gpu_memory_utilization: 1.5}", "{gpu_memory_utilization: 0}", "{kv_cache_gib: 0}"):
        with pytest.raises(ConfigError, match="vllm"):
            _train(tmp_path, bad)


def test_the_plans_engine_and_colocated_trainer_move_with_the_fraction() -> None:
    spec = load_spec(ROOT / "recipes" / "models" / "llama3.plan.yaml")
    assert spec.colocate
    small, large = (
        make_plan(spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"memory_fraction": f})}))
        for f in (0.4, 0.5)
    )
    gpu = spec.nodes[0].gpu_memory_gib * GIB
    assert large.engine.capacity - small.engine.capacity == pytest.approx(0.1 * gpu)
    assert large.engine.terms[1].bytes - small.engine.terms[1].bytes == pytest.approx(0.1 * gpu)  # all of it KV
    assert small.trainer.capacity - large.trainer.capacity == pytest.approx(0.1 * gpu)  # the trainer's share shrinks
