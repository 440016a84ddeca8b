"""The config tree and the `furlong` command as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import skips
import torch

from furlong.build.training import check_devices
from furlong.config import ConfigError, load_config
from furlong.run.phases import sft_device


def test_overrides_and_recipes_are_typed(tmp_path: Path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval:\n  concurrency: 3\n  agent: noop\n")
    cfg = load_config(recipe, ["eval.concurrency=5", "sandbox.output_cap_bytes=4096", "eval.per_family=null"])
    assert (cfg.eval.concurrency, cfg.eval.agent, cfg.sandbox.output_cap_bytes) == (5, "noop", 4096)
    assert cfg.eval.per_family is None


@pytest.mark.parametrize("override, words", [
    ("eval.concurency=3", "eval.concurency: Extra inputs are not permitted"),
    ("eval.concurrency=many", "eval.concurrency: Input should be a valid integer"),
    ("eval.agent=genius", "eval.agent: Input should be 'oracle', 'noop' or 'model'"),
    ("concurrency", "expected key=value"),
])
def test_bad_overrides_name_the_key(override: str, words: str):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(None, [override])


@pytest.mark.parametrize("override, suggestion", [
    ("eval.concurency=3", "; did you mean eval.concurrency?"),
    ("trian.seed=3", "; did you mean train?"),
    ("sandbox.network.verifer=packages", "; did you mean sandbox.network.verifier?"),
    ("train.rl.stpes=3", "; did you mean train.rl.steps?"),
    ("train.env.rewards.short.wieght=1", "; did you mean train.env.rewards.short.weight?"),  # a named entry's key
    ("train.zzzz=1", None),  # nothing near: no guess
])
def test_an_unknown_key_names_the_nearest_valid_one(override: str, suggestion: str | None):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert "Extra inputs are not permitted" in message
    assert (suggestion in message) if suggestion else "did you mean" not in message, message


@pytest.mark.parametrize("overrides, words", [
    (["train.cluster=ray", "train.device=cuda"], "train.device=cuda needs train.ray.trainer_gpus > 0"),
    (["train.cluster=ray", "train.ray.trainer_gpus=0.5"], "train.device=cpu needs train.ray.trainer_gpus = 0"),
    (["train.ray.engine_gpus=-1"], "train.ray.engine_gpus: Input should be greater than or equal to 0"),
])
def test_gpu_settings_that_cannot_run_are_refused(overrides: list[str], words: str):
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)
    cfg = load_config(None, ["train.cluster=ray", "train.device=cuda", "train.ray.trainer_gpus=0.5",
                             "train.ray.engine_gpus=0.5"])
    assert (cfg.train.ray.trainer_gpus, cfg.train.ray.engine_gpus) == (0.5, 0.5)


@pytest.mark.parametrize("overrides", [["train.sync.engine=server", "train.sync.transport=http"], ["train.engine=vllm"], ["train.cluster=ray"]])
def test_a_deterministic_engine_elsewhere_than_in_process_is_refused(overrides: list[str]):
    with pytest.raises(ConfigError, match="train.hf.deterministic: only the in-process hf engine has it"):
        load_config(None, ["train.hf.deterministic=true", *overrides])
    assert load_config(None, ["train.hf.deterministic=true"]).train.hf.deterministic


@pytest.mark.parametrize("overrides, words", [
    (["train.ray.sandbox_hosts=2"], "sandbox host actors need train.cluster=ray"),
    (["train.cluster=ray", "train.ray.sandbox_hosts=2", "sandbox.backend=remote"], "drop sandbox.backend=remote"),
    (["train.cluster=ray", "train.ray.sandbox_hosts=-1"], "train.ray.sandbox_hosts: Input should be greater"),
])
def test_sandbox_host_actors_that_cannot_run_are_refused(overrides: list[str], words: str):
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)
    assert load_config(None, ["train.cluster=ray", "train.ray.sandbox_hosts=2"]).train.ray.sandbox_hosts == 2


@pytest.mark.parametrize("overrides, words", [
    (["train.engine=vllm", "train.lora.enabled=true"], "train.engine=vllm loads full weights into each engine actor"),
    (["train.engine=sglang", "train.lora.enabled=true"], "train.engine=sglang loads full weights"),
    (["train.engine=sglang", "train.sglang.url=http://127.0.0.1:30000"], "drop train.sglang.url"),
])
def test_ray_engine_servers_refuse_what_they_do_not_wire(overrides: list[str], words: str):
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["train.cluster=ray", *overrides])
    for engine in ("vllm", "sglang"):  # full-weight runs of either server are accepted on Ray
        assert load_config(None, ["train.cluster=ray", f"train.engine={engine}"]).train.engine == engine


@skips.skipif("gpu", torch.cuda.is_available(), "checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("override", ["train.device=cuda", "train.hf.device=cuda"])
def test_a_cuda_device_this_machine_lacks_is_a_config_error_naming_the_key(override: str):
    with pytest.raises(ConfigError, match=f"{override}: no CUDA device is visible"):
        check_devices(load_config(None, [override]).train)
    check_devices(load_config(None, ["train.cluster=ray", "train.device=cuda", "train.ray.trainer_gpus=1"]).train)


@skips.skipif("gpu", torch.cuda.is_available(), "checks the fallback on a machine without CUDA")
def test_sft_trains_on_train_device_and_on_ray_falls_back_to_the_drivers_cpu():
    assert sft_device(load_config(None, [])) == "cpu"
    on_ray = load_config(None, ["train.cluster=ray", "train.device=cuda", "train.ray.trainer_gpus=1"])
    assert sft_device(on_ray) == "cpu"  # the GPU is the trainer actor's; this driver has none
    assert sft_device(load_config(None, ["train.device=cuda"])) == "cuda"  # local: check_devices refuses it here


def test_bad_recipe_names_the_file(tmp_path: Path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("eval:\n  timeout: 3\n")
    with pytest.raises(ConfigError, match=f"in {recipe}"):
        load_config(recipe)


def _furlong(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_eval_writes_jsonl_and_reports_bad_input(tmp_path: Path):
    d = tmp_path / "suite" / "hello"
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text("[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 30\n")
    (d / "instruction.md").write_text("Create /tmp/hello")
    (d / "solution" / "solve.sh").write_text("touch /tmp/hello\n")
    (d / "tests" / "test.sh").write_text("test -f /tmp/hello && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    out = tmp_path / "out.jsonl"
    res = _furlong("eval", "--tasks", str(tmp_path / "suite"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["pass_rate"] == 1.0
    assert json.loads(out.read_text())["task"] == "hello"
    (d / "task.toml").write_text("[agent]\ntimeout_sec = 'x'\n")
    res = _furlong("eval", "--tasks", str(tmp_path / "suite"))
    assert res.returncode == 2 and "'hello': task.toml: field 'agent.timeout_sec'" in res.stderr
    res = _furlong("eval", "eval.concurency=2")
    assert res.returncode == 2 and "eval.concurency" in res.stderr


def test_bundled_recipes_load_and_default_matches_the_builtin():
    from furlong.config import RECIPES, Config

    for recipe in sorted(RECIPES.glob("*.yaml")):
        load_config(recipe)
    assert load_config(RECIPES / "default.yaml") == Config()


def test_train_refuses_more_heldout_episodes_than_a_family_has(tmp_path: Path):
    res = _furlong("train", f"train.run_dir={tmp_path / 'run'}", "train.eval.heldout_per_family=100000")
    assert res.returncode == 2
    message = " ".join(res.stderr.split())  # the console wraps long lines
    assert "train.eval.heldout_per_family: 100000 requested, but family 'number-stats' has 128" in message


def _one_line_error(res: subprocess.CompletedProcess) -> str:
    """The error a failed command printed: exit 2, no traceback, one `error:` line."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    return errors[0]


@pytest.mark.parametrize("args", [
    ("train", "train.model.path=/missing"),
    ("sft", "train.model.path=/missing"),
    ("engine", "serve", "--model", "/missing"),
])
def test_a_missing_checkpoint_is_one_line(tmp_path: Path, args: tuple[str, ...]):
    run_dir = () if args[0] == "engine" else (f"train.run_dir={tmp_path / 'run'}",)
    assert "/missing: not a directory" in _one_line_error(_furlong(*args, *run_dir))


def test_a_malformed_override_value_is_one_line():
    line = _one_line_error(_furlong("eval", "eval.concurrency=[1"))
    assert "override eval.concurrency=[1:" in line and "values are YAML" in line


def test_a_task_toml_typo_is_one_line(tmp_path: Path):
    d = tmp_path / "typo"
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text("[agent]\ntimeout_secs = 30\n")
    (d / "instruction.md").write_text("Create /tmp/hello")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    line = _one_line_error(_furlong("eval", "--tasks", str(d)))
    assert "task 'typo': task.toml: unknown key 'agent.timeout_secs'" in line


def test_a_family_of_a_billion_seeds_is_one_line(tmp_path: Path):
    d = tmp_path / "huge"
    d.mkdir()
    (d / "family.toml").write_text("[family]\ntrain_seeds = [0, 1000000000]\nheldout_seeds = [-10, 0]\n")
    (d / "generate.py").write_text("def generate(seed, out):\n    pass\n")
    line = _one_line_error(_furlong("eval", "--tasks", str(d)))
    assert "task 'huge': family.toml: field 'family.train_seeds': 1000000000 seeds" in line


@pytest.mark.parametrize("updated, steps, required, code, said", [
    (0, 4, False, 0, True),   # trained nothing: said, still exit 0 without the flag
    (0, 4, True, 1, True),    # --require-update: exit 1
    (2, 4, True, 0, False),   # some steps trained
    (0, 0, True, 0, False),   # no RL steps asked for: nothing to say
])
def test_a_run_whose_steps_never_updated_says_so(updated: int, steps: int, required: bool, code: int, said: bool,
                                                 capsys):
    from furlong.cli.main import _no_update_verdict
    assert _no_update_verdict({"rl_steps_updated": updated, "rl_steps": steps}, required) == code
    assert ("no RL step updated the policy" in capsys.readouterr().err) == said


_BARS = """
import sys, tempfile
from furlong.cli.common import quiet_library_bars
if sys.argv[1] == "quiet":
    quiet_library_bars()
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2)
with tempfile.TemporaryDirectory() as d:
    LlamaForCausalLM(cfg).save_pretrained(d)
    LlamaForCausalLM.from_pretrained(d)
"""


@pytest.mark.parametrize("mode, env, bars", [("quiet", {}, False), ("loud", {}, True),
                                             ("quiet", {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}, True)])
def test_train_and_sft_show_no_transformers_bars(mode: str, env: dict, bars: bool):
    """transformers' "Loading weights" bar is off in `furlong train`/`sft` (and what they start), unless asked."""
    clean = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    res = subprocess.run([sys.executable, "-c", _BARS, mode], env={**clean, **env, "TQDM_DISABLE": ""},
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert ("Loading weights" in res.stderr) == bars, res.stderr[-2000:]
