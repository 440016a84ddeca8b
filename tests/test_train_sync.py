"""`train.sync`: the RL loop's weights reaching its engine through published full/delta updates and a relay,
in this process or in a separate engine server process pulling over HTTP (a real uvicorn server on loopback)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from furlong.config import load_config
from furlong.engine.base import EngineError, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model.loading import load_model
from furlong.build.links import weight_link

PROMPT = [5, 17, 300, 42, 1000, 7]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _steps(model, count: int) -> list[dict[str, torch.Tensor]]:
    """Weights after `count` optimizer-like steps: every parameter moves by ~1e-3 per step."""
    g = torch.Generator().manual_seed(0)
    state = model.state_dict()
    first = {}  # tied tensors (embedding and output layer) stay one tensor under both names, as in a trainer
    for name, tensor in state.items():
        first.setdefault(tensor.data_ptr(), name)
    clones = {k: v.detach().clone() for k, v in state.items() if first[v.data_ptr()] == k}
    weights = {k: clones[first[state[k].data_ptr()]] for k in state}
    out = [weights]
    for _ in range(count):
        moved = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in weights.items() if first[state[k].data_ptr()] == k}
        weights = {k: moved[first[state[k].data_ptr()]] for k in state}
        out.append(weights)
    return out


async def _sample(engine, seed: int = 3):
    return await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed))


async def _reference(tiny_dir: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype):
    """What an in-process engine given the same weights (rounded to the published dtype) samples."""
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=())
    await engine.update_weights({k: v.to(dtype).float() for k, v in weights.items()}, 0)
    try:
        return await _sample(engine)
    finally:
        await engine.close()


@pytest.mark.parametrize("transport", ["http", "directory"])
def test_engine_server_pulls_deltas_and_samples_exactly_like_the_trainer_weights(tiny_dir: Path, tmp_path: Path,
                                                                                 transport: str):
    cfg = load_config(None, [f"train.sync.transport={transport}", "train.sync.engine=server",
                             "train.sync.full_every=3"])
    history = _steps(load_model(tiny_dir), 4)

    async def main() -> list[dict]:
        link = await weight_link(cfg, tmp_path, tiny_dir)
        logged = []
        try:
            for version, weights in enumerate(history):
                logged.append(await link.push(weights, version))
                got, want = await _sample(link.engine), await _reference(tiny_dir, weights, torch.float32)
                assert got.weight_version == version and link.engine.weight_version == version
                assert got.output_ids == want.output_ids
                assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
            with pytest.raises(EngineError, match="relay"):
                await link.engine.update_weights(history[0], 9)
        finally:
            await link.close()
        return logged

    logged = asyncio.run(main())
    assert [m["sync_full"] for m in logged] == [1.0, 0.0, 0.0, 1.0, 0.0]  # a snapshot every 3 publishes
    assert all(0 < m["sync_payload_ratio"] < 1 for m in logged if not m["sync_full"])
    assert all(m["sync_pause_s"] < m["sync_seconds"] for m in logged)
    assert (tmp_path / "engine-server.log").exists()


def test_in_process_relay_with_bf16_publishing_loads_the_rounded_weights(tiny_dir: Path, tmp_path: Path):
    cfg = load_config(None, ["train.sync.transport=inprocess", "train.sync.engine_dtype=bfloat16"])
    history = _steps(load_model(tiny_dir), 2)

    async def main() -> None:
        link = await weight_link(cfg, tmp_path, tiny_dir)
        try:
            for version, weights in enumerate(history):
                report = await link.push(weights, version)
                assert report["sync_payload_ratio"] < (0.6 if version else 1.0)  # bf16: at most half of fp32
                live = link.engine.model.state_dict()
                for name, tensor in weights.items():
                    assert torch.equal(live[name], tensor.to(torch.bfloat16).float()), name
        finally:
            await link.close()

    asyncio.run(main())


def test_an_unchanged_version_is_not_republished(tiny_dir: Path, tmp_path: Path):
    cfg = load_config(None, ["train.sync.transport=directory"])
    weights = _steps(load_model(tiny_dir), 0)[0]

    async def main() -> tuple[dict, dict]:
        link = await weight_link(cfg, tmp_path, tiny_dir)
        try:
            return await link.push(weights, 0), await link.push(weights, 0)  # a step whose groups were all filtered
        finally:
            await link.close()

    first, again = asyncio.run(main())
    assert first["sync_full"] == 1.0 and again == {"sync_seconds": 0.0}
    assert sorted(p.name for p in (tmp_path / "weights").glob("*.fwu")) == ["v000000000000.full.fwu"]


def test_furlong_train_with_its_engine_in_a_server_process(tmp_path: Path):
    from test_train_run import SMALL, _rl_rows, _train

    run = tmp_path / "served"
    res = _train(f"train.run_dir={run}", *SMALL, "train.rl.steps=2", "train.sync.transport=http",
                 "train.sync.engine=server")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in _rl_rows(run)] == [0, 1] and all("sync_seconds" in r for r in _rl_rows(run))
    assert (run / "weights" / "v000000000000.full.fwu").exists() and (run / "engine-server.log").exists()
    assert not _processes_mentioning(str(run)), "the engine server outlived the run"


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        if text in cmdline:
            found.append(cmdline)
    return found
