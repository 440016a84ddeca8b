"""SGLangEngine and its launcher against SGLangStandIn (tests/sglang_standin.py), a TEST DOUBLE of an SGLang
server (SGLang cannot run here): a real HTTP server on loopback with SGLang's request/response shapes, serving
the real tiny model, so tokens and logprobs are real. scripts/gpu_check.sh runs the same client on real SGLang.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import skips
import torch

from furlong.config import ConfigError, load_config
from furlong.engine.base import EngineError, SamplingParams
from furlong.engine.factory import make_engine
from furlong.engine.sglang import SGLangEngine
from furlong.engine.sglang_launch import SGLangLaunch, SGLangServer, free_port
from furlong.model import load_model
from furlong.train.logprobs import token_logprobs

STANDIN = "tests.sglang_standin"
TOL = 1e-4
PROMPT = [5, 17, 301, 42, 7, 99, 1024, 3]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    with SGLangServer(SGLangLaunch(model_dir=tiny_dir, log=log, module=STANDIN, start_timeout_s=120)) as s:
        yield s


def engine_for(server: SGLangServer, tmp_path: Path, model_dir: Path, **kw) -> SGLangEngine:
    return SGLangEngine(server.url, staging_dir=tmp_path / "staged", base_model_dir=model_dir, **kw)


def trainer_logprobs(model, prompt: list[int], output: tuple[int, ...], temperature: float) -> torch.Tensor:
    """What the trainer recomputes for the sampled tokens (furlong.train.logprobs)."""
    tokens = torch.tensor([prompt + list(output)])
    with torch.no_grad():
        lp = token_logprobs(model, tokens, torch.ones_like(tokens), temperature)
    return lp[0, len(prompt):]


def assert_trainer_match(model, gen, temperature: float) -> None:
    ref = trainer_logprobs(model, PROMPT, gen.output_ids, temperature)
    assert len(gen.logprobs) == len(gen.output_ids) == len(gen.token_weight_versions) > 0
    assert (ref - torch.tensor(gen.logprobs)).abs().max().item() <= TOL


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    """New weights for every parameter; named_parameters() lists tied tensors (embeddings / lm_head) once."""
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.named_parameters()}


def test_generate_logprobs_match_the_trainer(server, tiny_dir, tmp_path):
    model = load_model(tiny_dir)

    async def go():
        engine = engine_for(server, tmp_path, tiny_dir)
        for temperature in (1.0, 0.7, 0.0):
            gen = await engine.generate(PROMPT, SamplingParams(temperature=temperature, max_new_tokens=12, seed=3))
            assert gen.finish_reason in ("stop", "length") and gen.prompt_len == len(PROMPT)
            assert gen.weight_version == 0 and set(gen.token_weight_versions) == {0}
            assert_trainer_match(model, gen, temperature)
        a, b = [await engine.generate(PROMPT, SamplingParams(max_new_tokens=12, seed=11)) for _ in range(2)]
        assert a.output_ids == b.output_ids  # sampling_seed makes a request reproducible
        capped = await engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=3))
        assert capped.num_tokens <= 3
        await engine.close()

    run(go())


def test_score_reads_sglangs_input_token_logprobs(server, tiny_dir, tmp_path):
    """Engine.score over /generate's return_logprob from logprob_start_len (the stand-in answers with its hf
    engine's score, shaped as SGLang's input_token_logprobs): the trainer's logprobs of PROMPT[start:]."""
    async def go():
        engine = engine_for(server, tmp_path, tiny_dir)
        try:
            got = await engine.score(PROMPT, 2)
            with pytest.raises(EngineError, match="temperature"):
                await engine.score(PROMPT, 2, 0.7)
            with pytest.raises(EngineError, match="start"):
                await engine.score(PROMPT, 0)
            return got
        finally:
            await engine.close()

    got = run(go())
    want = trainer_logprobs(load_model(tiny_dir), PROMPT[:2], tuple(PROMPT[2:]), 1.0)
    assert len(got) == len(PROMPT) - 2
    assert (want - torch.tensor(got)).abs().max().item() <= TOL


def test_update_from_disk_changes_outputs_and_bumps_version(server, tiny_dir, tmp_path):
    model = load_model(tiny_dir)

    async def go():
        engine = engine_for(server, tmp_path, tiny_dir)
        before = await engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=8))
        new = perturbed(model, seed=1)
        await engine.update_weights(new, version=1)
        assert engine.weight_version == 1 and engine.last_update["sync_pause_s"] > 0
        assert [p.name for p in (tmp_path / "staged").iterdir()] == ["v1"]
        model.load_state_dict(new, strict=False)
        after = await engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=8))
        assert after.weight_version == 1 and set(after.token_weight_versions) == {1}
        assert after.logprobs != before.logprobs
        assert_trainer_match(model, after, 0.0)
        assert (await engine.model_info())["weight_version"] == "1"

        via_tensor = engine_for(server, tmp_path, tiny_dir, weights_via="tensor")
        newer = perturbed(model, seed=2)
        await via_tensor.update_weights(newer, version=2)
        model.load_state_dict(newer, strict=False)
        gen = await via_tensor.generate(PROMPT, SamplingParams(temperature=0.8, max_new_tokens=8, seed=1))
        assert gen.weight_version == 2
        assert_trainer_match(model, gen, 0.8)
        await engine.close()
        await via_tensor.close()

    run(go())


def save_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter with non-zero B, so it changes the model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                  init_lora_weights=False))
    peft_model.save_pretrained(out)
    return out


def test_lora_load_select_unload(tiny_dir, tmp_path):
    from peft import PeftModel

    adapter = save_adapter(tiny_dir, tmp_path / "adapter")
    merged = PeftModel.from_pretrained(load_model(tiny_dir), str(adapter)).merge_and_unload()
    sampling = SamplingParams(temperature=0.9, max_new_tokens=8, seed=5)

    async def go(url: str):
        engine = SGLangEngine(url)
        await engine.load_lora("a", adapter)
        engine.select_lora("a")
        with_adapter = await engine.generate(PROMPT, sampling)
        engine.select_lora(None)
        without = await engine.generate(PROMPT, sampling)
        assert with_adapter.logprobs != without.logprobs
        await engine.unload_lora("a")
        engine.select_lora("a")
        with pytest.raises(EngineError, match="not loaded"):
            await engine.generate(PROMPT, sampling)
        await engine.close()
        return with_adapter

    # A server of its own: the shared one's base weights are changed by the update test.
    with SGLangServer(SGLangLaunch(model_dir=tiny_dir, log=tmp_path / "lora.log", module=STANDIN)) as fresh:
        gen = run(go(fresh.url))
    assert_trainer_match(merged, gen, 0.9)


def test_pause_holds_requests_until_continue_and_flush_cache(server, tiny_dir, tmp_path):
    async def go():
        engine = engine_for(server, tmp_path, tiny_dir)
        await engine.pause()
        pending = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=6, seed=1)))
        done, _ = await asyncio.wait([pending], timeout=1.0)
        assert not done  # paused in place: the request waits with its state
        assert await engine.flush_cache() is False  # SGLang refuses while a request is in flight
        await engine.resume()
        gen = await asyncio.wait_for(pending, 30)
        assert gen.num_tokens > 0
        assert await engine.flush_cache() is True
        await engine.close()

    run(go())


def test_dead_server_is_a_clear_error_not_a_hang(tiny_dir, tmp_path):
    async def refused():
        engine = SGLangEngine(f"http://127.0.0.1:{free_port('127.0.0.1')}", connect_timeout_s=2)
        start = time.monotonic()
        with pytest.raises(EngineError, match="SGLang at http://127.0.0.1:.*/generate"):
            await engine.generate(PROMPT)
        assert not await engine.health()
        assert time.monotonic() - start < 5
        await engine.close()

    run(refused())
    server = SGLangServer(SGLangLaunch(model_dir=tiny_dir, log=tmp_path / "dies.log", module=STANDIN))

    async def killed_mid_request():
        engine = SGLangEngine(server.url)
        await engine.pause()
        pending = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=6)))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(server.stop)
        with pytest.raises(EngineError, match="/generate"):
            await asyncio.wait_for(pending, 20)
        await engine.close()

    run(killed_mid_request())


def test_launcher_reports_a_failed_start_with_the_log_tail(tmp_path):
    start = time.monotonic()
    with pytest.raises(EngineError) as err:
        SGLangServer(SGLangLaunch(model_dir=tmp_path / "missing", log=tmp_path / "bad.log", module=STANDIN))
    assert "exited with code" in str(err.value) and "not a directory" in str(err.value)
    assert time.monotonic() - start < 60


def test_launcher_times_out_and_stops_the_process(tiny_dir, tmp_path):
    with pytest.raises(EngineError, match="not healthy .* within"):
        SGLangServer(SGLangLaunch(model_dir=tiny_dir, log=tmp_path / "slow.log", module=STANDIN, start_timeout_s=0.3))


def test_config_and_factory(tiny_dir, tmp_path):
    cfg = load_config(overrides=["train.engine=sglang", f"train.sglang.launch_module={STANDIN}"])
    assert cfg.train.engine == "sglang" and cfg.train.sglang.weights_via == "disk"
    with pytest.raises(ConfigError, match="train.engine"):
        load_config(overrides=["train.engine=tgi"])
    with pytest.raises(ConfigError, match="weights_via"):
        load_config(overrides=["train.sglang.weights_via=nccl"])
    engine = make_engine("sglang", tiny_dir, sglang=cfg.train.sglang, work_dir=tmp_path)

    async def go():
        gen = await engine.generate(PROMPT, SamplingParams(max_new_tokens=4, seed=0))
        assert gen.num_tokens > 0
        await engine.close()

    run(go())
    assert not engine.server.running and (tmp_path / "sglang-server.log").is_file()


@skips.skipif("gpu", shutil.which("nvidia-smi") is not None, "on a GPU machine the script really installs")
def test_gpu_check_script_parses_and_refuses_without_a_gpu(tmp_path):
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(["bash", str(script), "--work", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.startswith("FAIL gpu: no NVIDIA GPU")


def test_update_from_distributed_receives_the_trainers_broadcast(server, tiny_dir, tmp_path):
    """SGLang's /init_weights_update_group + /update_weights_from_distributed, driven by furlong's BroadcastLink
    (the trainer is rank 0 of a real gloo group; the stand-in is rank 1)."""
    from furlong.train.weights import BroadcastLink

    model = load_model(tiny_dir)

    async def go():
        engine = engine_for(server, tmp_path, tiny_dir)
        link = await BroadcastLink.open(engine, [engine], backend="gloo", cleanup=engine.close, timeout_s=60)
        try:
            new = perturbed(model, seed=3)
            synced = await link.push(new, 3)
            assert synced["sync_payload_bytes"] == sum(t.numel() * 4 for t in new.values()) and engine.weight_version == 3
            model.load_state_dict(new, strict=False)
            gen = await engine.generate(PROMPT, SamplingParams(temperature=0.8, max_new_tokens=8, seed=1))
            assert gen.weight_version == 3
            assert_trainer_match(model, gen, 0.8)
            assert (await engine.model_info())["weight_version"] == "3"
        finally:
            await link.close()

    run(go())
