"""`furlong train --plan`: the parameter, memory and update-byte formulas, errors naming fields, the CLI dry run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from furlong.cluster.plan import make_plan
from furlong.cluster.shapes import kv_bytes_per_token, lora_params, model_params
from furlong.cluster.spec import ClusterSpec, ModelSpec, hf_model, load_spec

ROOT = Path(__file__).resolve().parent.parent
MILES = ROOT / "recipes/cluster/miles-glm5.yaml"
DENSE = ROOT / "recipes/cluster/dense-32b-8gpu.yaml"

# hidden 8, 2 heads of 4, 1 kv head, ffn 16, vocab 10, 2 layers, untied. By hand:
# embedding 10x8 = 80; a layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, MLP 3x8x16 = 384, 2 norms 16 -> 592;
# final norm 8, lm_head 80. Total 80 + 2x592 + 8 + 80 = 1352.
SMALL = {"layers": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "head_dim": 4, "ffn": 16, "vocab": 10}


def _spec(**over) -> ClusterSpec:
    raw = {"nodes": [{"name": "n", "count": 1, "gpus": 2, "gpu_memory_gib": 1, "cpus": 8, "memory_gib": 16},
                     {"name": "c", "count": 1, "cpus": 8, "memory_gib": 16}],
           "model": SMALL,
           "trainer": {"gpus": 1, "shard": "none", "seq_len": 4, "activation_checkpointing": False,
                       "reserved_gib": 0},
           "rollout": {"gpus": 1}}
    for key, value in over.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return ClusterSpec.model_validate(raw)


def test_small_model_parameters_memory_and_update_bytes_match_hand_computed_values():
    spec = _spec()
    assert model_params(spec.model).total == 1352
    mem = {t.name: t.bytes for t in make_plan(spec).trainer.terms}
    assert mem["parameters"] == 1352 * 2  # bf16
    assert mem["gradients"] == 1352 * 4  # fp32 gradients
    assert mem["optimizer"] == 1352 * 12  # fp32 master + two fp32 Adam moments
    # saved per token per layer: attention 2x8 (norm in/out) + 2x8 (q) + 2x4 (k, v) + 8 (o's input) = 48,
    # MLP 2x8 + 3x16 = 64 -> 112; 4 tokens x 2 B x 2 layers x 112
    assert mem["activations"] == 4 * 2 * 2 * 112
    assert mem["logits"] == 4 * 10 * 4
    checkpointed = {t.name: t.bytes for t in make_plan(_spec(trainer={"activation_checkpointing": True})).trainer.terms}
    assert checkpointed["activations (checkpointed)"] == 4 * 2 * (2 * 8 + 112)  # each layer's input + one layer
    assert make_plan(spec).updates[0].bytes == 1352 * 2  # a full update in the engine's bf16
    assert lora_params(spec.model, 2, ("attention",)) == 2 * 2 * ((8 + 8) + (8 + 4) + (8 + 4) + (8 + 8))
    assert kv_bytes_per_token(spec.model, 2, tp=1, dp_attention=False) == 2 * 2 * 1 * 4 * 2


def test_sharding_divides_by_the_parallel_sizes():
    spec = _spec(nodes=[{"name": "n", "count": 1, "gpus": 8, "gpu_memory_gib": 1, "cpus": 8, "memory_gib": 16}],
                 trainer={"gpus": 4, "tp": 2, "shard": "full"}, rollout={"gpus": 2, "tp": 2})
    mem = {t.name: t.bytes for t in make_plan(spec).trainer.terms}
    assert mem["parameters"] == 1352 / 2 / 2 * 2  # / tp2 / dp2, bf16
    assert mem["optimizer"] == 1352 / 4 * 12


def test_parameter_count_of_the_tiny_model_from_its_config_json(tmp_path: Path):
    from furlong.model.tiny import TinySpec, build_model

    model = build_model(TinySpec(), seed=0, vocab_size=4096, eos_id=1, pad_id=2)
    model.config.to_json_file(tmp_path / "config.json")
    spec = ModelSpec.model_validate(hf_model(tmp_path / "config.json"))
    assert model_params(spec).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["glm_moe_dsa", "qwen3_moe", "qwen2"])
def test_parameter_count_of_moe_and_mla_configs_matches_torch(tmp_path: Path, kind: str):
    import transformers

    small = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    config = {"glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
                  **{**small, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
                  qk_nope_head_dim=12, index_n_heads=2, index_head_dim=16, first_k_dense_replace=1, index_topk=4),
              "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**small, moe_intermediate_size=32, num_experts=8,
                                                               num_experts_per_tok=2, head_dim=16),
              "qwen2": lambda: transformers.Qwen2Config(**small, tie_word_embeddings=False)}[kind]()
    config.to_json_file(tmp_path / "config.json")
    model = transformers.AutoModelForCausalLM.from_config(config)
    counted = model_params(ModelSpec.model_validate(hf_model(tmp_path / "config.json")))
    assert counted.total == sum(p.numel() for p in model.parameters())
    if kind != "qwen2":
        assert 0 < counted.active < counted.total


def test_glm5_matches_its_published_size():
    p = model_params(load_spec(MILES).model)
    assert round(p.total / 1e9) == 744  # 744B total (MTP layer apart), about 40B active
    assert 40e9 <= p.active <= 44e9


def test_a_spec_that_cannot_fit_names_the_role_and_the_numbers(tmp_path: Path):
    raw = yaml.safe_load(MILES.read_text())
    raw["trainer"]["optimizer_offload"] = "none"  # Miles streams it to disk: without that, ~300 GiB a rank
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    problems = make_plan(load_spec(tmp_path / "c.yaml")).problems
    assert len(problems) == 1
    assert problems[0].startswith("does not fit: trainer rank needs ")
    assert "GiB but a GPU has 264.0 GiB" in problems[0]
    assert not make_plan(load_spec(MILES)).problems
    too_many = _spec(sandboxes={"concurrent": 9, "cpus": 1, "memory_gib": 1})
    assert make_plan(too_many).problems == ("does not fit: sandboxes: 9 x (1 CPU, 1 GiB) but the CPU nodes hold 8",)


@pytest.mark.parametrize("text, field", [
    ("nodes: []\n", "nodes"),
    ("- a\n", "expected a mapping"),
    ("nodes: [{name: n, count: 1, gpus: 2, cpus: 4, memory_gib: 8}]\nmodel: {}\ntrainer: {}\nrollout: {}\n",
     "nodes.0: Value error, gpu_memory_gib is required"),
    ("nodes: [{name: n, count: 1, cpus: 4, memory_gib: 8}]\nmodel: {layers: 1}\ntrainer: {gpus: 1, seq_len: 8,"
     " tp: two}\nrollout: {gpus: 1, tpp: 2}\n", "trainer.tp: Input should be a valid integer"),
    ("nodes: [{name: n, count: 1, cpus: 4, memory_gib: 8}]\nmodel: {layers: 1}\ntrainer: {gpus: 1, seq_len: 8}"
     "\nrollout: {gpus: 1, tpp: 2}\n", "rollout.tpp: Extra inputs are not permitted"),
])
def test_bad_yaml_names_the_field(tmp_path: Path, text: str, field: str):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ValueError, match=field):
        load_spec(tmp_path / "c.yaml")


def test_hf_config_path_is_read_and_a_missing_key_named(tmp_path: Path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m/config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 8, '
                                            '"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}')
    raw = {"nodes": [{"name": "n", "count": 1, "gpus": 1, "gpu_memory_gib": 1, "cpus": 1, "memory_gib": 1}],
           "model": {"hf_config": "m"}, "trainer": {"gpus": 1, "seq_len": 4}, "rollout": {"gpus": 1}, "colocate": True}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="model.hf_config has no 'intermediate_size'"):
        load_spec(tmp_path / "c.yaml")
    config = json.loads((tmp_path / "m/config.json").read_text())
    (tmp_path / "m/config.json").write_text(json.dumps({**config, "intermediate_size": 16}))
    raw["model"]["layers"] = 1  # a key beside hf_config overrides the file's
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    model = load_spec(tmp_path / "c.yaml").model
    assert (model.layers, model.ffn, model.kv, model.attention.qkv_bias) == (1, 16, 1, True)


def test_impossible_placement_says_what_is_short():
    with pytest.raises(ValueError, match=r"trainer.gpus \+ rollout.gpus = 3 but the nodes have 2 GPUs"):
        make_plan(_spec(trainer={"gpus": 2}))
    with pytest.raises(ValueError, match=r"trainer.ep > 1 needs a model with moe"):
        make_plan(_spec(trainer={"gpus": 2, "ep": 2}, colocate=True))


def test_cli_prints_both_worked_examples_and_starts_nothing():
    probe = ("import sys; from furlong.cli import main; rc = main(sys.argv[1:]); "
             "loaded = [m for m in ('ray', 'torch', 'transformers', 'vllm', 'sglang') if m in sys.modules]; "
             "print('LOADED', loaded); sys.exit(rc)")
    for path, expect in ((MILES, ["engine 7", "gb15:0-3", "gb0:0-3, gb1:0-3", "cpu0..cpu3 (4 nodes)",
                                  "743,911,199,232 parameters", "trainer -> 8 relays"]),
                         (DENSE, ["h200-0:0-3", "engine 1", "h200-0:6-7", "LoRA r64"])):
        out = subprocess.run([sys.executable, "-c", probe, "train", "--plan", str(path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        for text in expect + ["placement", "memory per trainer rank", "memory per engine GPU", "nothing started"]:
            assert text in out.stdout, text
        assert "LOADED []" in out.stdout
        printed = "\n".join(line.rstrip() for line in out.stdout.splitlines() if not line.startswith("LOADED"))
        assert printed in (ROOT / "docs/plan.md").read_text(), f"docs/plan.md shows an old output of {path.name}"
    cli = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--plan", str(DENSE)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "each weight update (lora)" in cli.stdout, cli.stderr
