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
from furlong.cluster.spec import ClusterSpec, Delta, ModelSpec, hf_model, load_spec
from furlong.cluster.timing import attention_flops, decode_step
from furlong.cluster.updates import delta_bytes, position_bits

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
    if kind == "glm_moe_dsa":  # DSA's top-k caps the keys attention reads
        assert ModelSpec.model_validate(hf_model(tmp_path / "config.json")).attention.index_topk == 4


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
    (("nodes: [{name: n, count: 1, cpus: 4, memory_gib: 8}]\nmodel: {layers: 1}\ntrainer: {gpus: 1, seq_len: 8,"
     " tp: two}\nrollout: {gpus: 1, tpp: 2}\n"), "trainer.tp: Input should be a valid integer"),
    (("nodes: [{name: n, count: 1, cpus: 4, memory_gib: 8}]\nmodel: {layers: 1}\ntrainer: {gpus: 1, seq_len: 8}"
     "\nrollout: {gpus: 1, tpp: 2}\n"), "rollout.tpp: Extra inputs are not permitted"),
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
                                  "743,911,199,232 parameters", "trainer -> 8 relays", "per update: full",
                                  "async: max(rollout, train + weight sync)"]),
                         (DENSE, ["h200-0:0-3", "engine 1", "h200-0:6-7", "LoRA r64", "time per step"])):
        out = subprocess.run([sys.executable, "-c", probe, "train", "--plan", str(path)], cwd=ROOT, check=False,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        for text in expect + ["placement", "memory per trainer rank", "memory per engine GPU", "nothing started"]:
            assert text in out.stdout, text
        assert "LOADED []" in out.stdout
        printed = "\n".join(line.rstrip() for line in out.stdout.splitlines() if not line.startswith("LOADED"))
        assert printed in (ROOT / "docs/plan.md").read_text(), f"docs/plan.md shows an old output of {path.name}"
    cli = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--plan", str(DENSE)], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "each weight update (lora)" in cli.stdout, cli.stderr


STEP = {"prompts": 2, "group_size": 2, "prompt_tokens": 3, "response_tokens": 5, "gpu_tflops": 1e-6,
        "gpu_hbm_tbs": 1e-9, "mfu": 0.5, "mbu": 0.5}  # 1e6 FLOP/s and 1000 B/s a GPU, half of each reached


def test_train_and_decode_terms_match_hand_computed_values():
    spec = _spec(step=STEP)
    p = model_params(spec.model)
    terms = {t.name: t.seconds for t in make_plan(spec).step.terms}
    # attention at 4 keys (a sample's 8 tokens / 2): 2 x 2 layers x 2 heads x (4 + 4) x 4 = 256 FLOPs a token;
    # 3 passes (forward, backward x 2; no checkpointing) over 4 samples x 8 tokens
    assert attention_flops(spec.model, 4) == 256
    assert terms["train"] == pytest.approx(3 * 32 * (2 * 1352 + 256) / (1e6 * 0.5))
    # decode step at batch 2, context 3 + 5/2: bf16 weights 2704 B + KV 2 x 5.5 tokens x 32 B, at 500 B/s
    assert decode_step(spec, p, 2, 5.5)[0] == pytest.approx((2704 + 2 * 5.5 * 32) / 500)
    assert "memory-bound" in decode_step(spec, p, 2, 5.5)[1]
    # prefill: 3 tokens x (2 x 1352 + attention at 5.5 keys: 352) / (1 GPU x 1e6 x 0.5)
    assert terms["prefill, per sample"] == pytest.approx(3 * (2704 + 352) / 5e5)
    # with ample bandwidth the step is FLOP-bound: 2 tokens x (2 x 1352 + 352) at 5e5 FLOP/s
    fast = _spec(step={**STEP, "gpu_hbm_tbs": 1e3})
    seconds, detail = decode_step(fast, p, 2, 5.5)
    assert seconds == pytest.approx(2 * 3056 / 5e5) and "compute-bound" in detail
    # the batch an engine decodes is its in-flight samples' decoding share: 4 x decode / latency
    latency = terms["prefill, per sample"] + terms["decode, per sample"]
    batch = 4 * terms["decode, per sample"] / latency
    assert terms["decode, per sample"] == pytest.approx(5 * decode_step(spec, p, batch, 5.5)[0], rel=1e-6)


def test_moe_decode_reads_only_the_experts_its_tokens_route_to():
    moe = {**SMALL, "moe": {"experts": 4, "active": 1, "ffn": 8}}
    spec = _spec(model=moe, step={**STEP, "spec_accept": 2})
    p = model_params(spec.model)
    for batch in (1, 3):
        touched = 1 - (1 - 1 / 4) ** (2 * batch)  # 2 tokens a sample a step with spec_accept 2
        weights = (p.total - p.experts + p.experts * touched) * 2
        kv = batch * 32 * 5.5
        assert decode_step(spec, p, batch, 5.5)[0] == pytest.approx((weights + kv) / 500)


def test_sync_adds_the_terms_and_async_overlaps_rollout_with_training():
    for mode in ("sync", "async"):
        step = make_plan(_spec(step={**STEP, "mode": mode, "concurrent": 3, "env_seconds": 7})).step
        t = {x.name: x.seconds for x in step.terms}
        latency = t["prefill, per sample"] + t["decode, per sample"] + t["environment, per sample"]
        if mode == "sync":  # 4 samples, 3 at a time: two waves
            assert t["rollout"] == pytest.approx(2 * latency)
            assert step.seconds == pytest.approx(t["rollout"] + t["train"] + t["weight sync"])
        else:  # steady state: 3 in flight finish 4 samples in 4/3 latencies
            assert t["rollout"] == pytest.approx(4 * latency / 3)
            assert step.seconds == pytest.approx(max(t["rollout"], t["train"] + t["weight sync"]))
    with pytest.raises(ValueError, match="step.mode async needs the engines on their own GPUs"):
        _spec(step={**STEP, "mode": "async"}, colocate=True)


def test_a_batch_beyond_the_kv_cache_is_named_and_capped():
    # each engine GPU: 1 GiB x 0.85 - 2704 B of weights, at 32 B a token; samples of 8 tokens
    plan = make_plan(_spec(step={**STEP, "prompts": 10 ** 7, "group_size": 1}))
    room = int((0.85 * 2 ** 30 - 2704) / 32 // 8)
    assert plan.problems == ((f"does not fit: KV cache: {10 ** 7} samples of 8 tokens in flight but the engines "
                             f"hold {room}; the step time assumes {room}"),)


def test_delta_size_and_its_cpu_stages():
    assert position_bits(0.5) == 1.0
    assert delta_bytes(1352, Delta(changed_fraction=0.5, value_bits=3)) == 1352 * (1 + 0.5 * 3) / 8
    # the defaults come from the GRPO steps at the recipe's lr in bench/results/weight_sync.json
    row = next(r for r in json.loads((ROOT / "bench/results/weight_sync.json").read_text())["summary"]
               if r["lr"] == 2e-4)
    assert delta_bytes(row["full_bytes"] // 2, Delta()) == pytest.approx(row["furlong_bytes"], rel=0.01)
    assert Delta().changed_fraction == pytest.approx(row["density"], abs=5e-4)
    spec = _spec(sync="delta", delta={"changed_fraction": 0.5, "value_bits": 3, "encode_gbs": 1e-6,
                                      "apply_gbs": 2e-6})
    plan = make_plan(spec)
    rows = {u.what.split(",")[0]: u for u in plan.updates}
    assert rows["delta"].bytes == 1352 * 2.5 / 8
    assert rows["encode on the trainer (1 core)"].seconds == pytest.approx(2704 / 1000)
    assert rows["apply on each relay"].seconds == pytest.approx(2704 / 2000)
    assert rows["relays -> 1 engines"].bytes == 2704  # the engine loads the whole tensors the relay rebuilt
    paths = {x.kind: x for x in plan.paths}
    assert paths["delta"].seconds == pytest.approx(2.704 + 1.352 + 2704 / 450e9)
    assert paths["full"].sent == 2704 and paths["full"].seconds == pytest.approx(2704 / 450e9)


def test_uneven_pipeline_split_puts_the_layers_where_it_says():
    four = {**SMALL, "layers": 4}
    spec = _spec(model=four, trainer={"gpus": 2, "pp": 2, "pp_layers": [1, 3]}, colocate=True)
    # stage 1: 3 layers x 592 + final norm 8 + lm_head 80; fuller than stage 0 (embedding 80 + one layer)
    assert {t.name: t.bytes for t in make_plan(spec).trainer.terms}["parameters"] == (3 * 592 + 88) * 2
    assert "pp2 (layers 1/3)" in make_plan(spec).placement[0].detail
    with pytest.raises(ValueError, match="trainer.pp_layers sums to 3 but the model has 4 layers"):
        _spec(model=four, trainer={"gpus": 2, "pp": 2, "pp_layers": [1, 2]}, colocate=True)
    with pytest.raises(ValueError, match=r"pp_layers needs pp \(2\) counts of at least 1"):
        _spec(model=four, trainer={"gpus": 2, "pp": 2, "pp_layers": [4]}, colocate=True)


@pytest.mark.parametrize("section, field", [("step", "tokens"), ("delta", "fraction")])
def test_unknown_step_and_delta_keys_are_named(tmp_path: Path, section: str, field: str):
    raw = yaml.safe_load(DENSE.read_text())
    raw[section] = {**raw.get(section, {}), field: 1}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=f"{section}.{field}: Extra inputs are not permitted"):
        load_spec(tmp_path / "c.yaml")


def test_a_distillation_teacher_adds_its_weights_to_each_rank_and_its_prefill_to_the_step(tmp_path: Path):
    # a checkpoint teacher twice the student's layers: 80 + 4 x 592 + 8 + 80 = 2536 parameters, bf16
    big = {**SMALL, "layers": 4}
    spec = _spec(step=STEP, teacher={"model": big})
    plan = make_plan(spec)
    mem = {t.name: t.bytes for t in plan.trainer.terms}
    assert mem["teacher weights (frozen)"] == 2536 * 2
    sharded = make_plan(_spec(nodes=[{"name": "n", "count": 1, "gpus": 8, "gpu_memory_gib": 1, "cpus": 8,
                                      "memory_gib": 16}], trainer={"gpus": 4, "tp": 2, "shard": "full"},
                              rollout={"gpus": 2, "tp": 2}, teacher={"model": big}))
    assert {t.name: t.bytes for t in sharded.trainer.terms}["teacher weights (frozen)"] == 2536 / 2 / 2 * 2
    # its prefill: one forward over 4 samples x 8 tokens, attention at 4 keys over its 4 layers (512 FLOPs)
    t = {x.name: x.seconds for x in plan.step.terms}
    assert t["teacher prefill"] == pytest.approx(32 * (2 * 2536 + 512) / (1e6 * 0.5))
    assert plan.step.seconds == pytest.approx(t["rollout"] + t["teacher prefill"] + t["train"] + t["weight sync"])
    # a self teacher is the policy: no weights of its own, one forward pass of the student
    own = make_plan(_spec(step=STEP, teacher={"kind": "self"}))
    assert "teacher weights (frozen)" not in {x.name for x in own.trainer.terms}
    assert {x.name: x.seconds for x in own.step.terms}["teacher prefill"] == pytest.approx(
        32 * (2 * 1352 + 256) / (1e6 * 0.5))
    with pytest.raises(ValueError, match="teacher.model"):
        _spec(teacher={"kind": "self", "model": big})
    # a spec file's teacher may read its shape from a Hugging Face config.json
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 4, "intermediate_size": 16, "vocab_size": 10, "model_type": "llama"}))
    raw = spec.model_dump(exclude={"teacher"})
    raw["teacher"] = {"model": {"hf_config": "t"}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(raw))))
    assert model_params(load_spec(tmp_path / "spec.yaml").teacher.model).total == 2536


def test_colocated_engines_take_their_memory_fraction_from_the_trainers_gpu():
    # hidden 8 x vocab 10 model on 1 GiB GPUs: apart, the trainer may fill the whole GPU; colocated, the engine's
    # memory_fraction of it is the engine's, and the trainer gets the rest
    apart = make_plan(_spec(rollout={"memory_fraction": 0.75}))
    shared = make_plan(_spec(trainer={"gpus": 2}, rollout={"memory_fraction": 0.75}, colocate=True))
    assert apart.trainer.capacity == 1 * 2**30
    assert shared.trainer.capacity == 0.25 * 2**30
    tight = _spec(trainer={"gpus": 2, "seq_len": 2**21}, rollout={"memory_fraction": 0.75}, colocate=True)
    assert any("colocated engines' memory_fraction" in p for p in make_plan(tight).problems)


def test_a_teacher_on_its_own_engine_is_an_engine_role_not_trainer_memory():
    """teacher.engine hf|vllm (train.distill.teacher.engine): the teacher's weights leave the trainer rank for
    GPUs of its own engine, placed after the rollout engines, and its prefill runs on those GPUs."""
    big = {**SMALL, "layers": 4}  # 2536 parameters, bf16 (the test above)
    nodes = [{"name": "n", "count": 1, "gpus": 4, "gpu_memory_gib": 1, "cpus": 8, "memory_gib": 16}]
    plan = make_plan(_spec(nodes=nodes, step=STEP, teacher={"model": big, "engine": "vllm", "gpus": 2}))
    assert "teacher weights (frozen)" not in {t.name for t in plan.trainer.terms}
    assert plan.teacher is not None and plan.teacher.terms[0].bytes == 2536 * 2 / 2
    role = {a.role: a for a in plan.placement}["teacher engine"]
    assert role.devices == "n0:2-3" and "vllm tp2" in role.detail
    t = {x.name: x.seconds for x in plan.step.terms}
    assert t["teacher prefill"] == pytest.approx(32 * (2 * 2536 + 512) / (2 * 1e6 * 0.5))
    assert plan.step.seconds == pytest.approx(t["rollout"] + t["teacher prefill"] + t["train"] + t["weight sync"])
    with pytest.raises(ValueError, match="teacher.gpus"):  # 1 + 1 + 4 GPUs on a 4-GPU node
        make_plan(_spec(nodes=nodes, teacher={"model": big, "engine": "hf", "gpus": 4}))
    with pytest.raises(ValueError, match="teacher.engine"):
        _spec(teacher={"kind": "self", "engine": "hf"})
    huge = {**SMALL, "vocab": 200_000, "hidden": 4096}  # 1.6 GB of embeddings alone: more than 0.85 x 1 GiB
    assert any("teacher engine GPU" in x for x in make_plan(_spec(nodes=nodes, teacher={"model": huge, "engine": "hf"})).problems)
