"""Builders for a run's rollout engines and the weight link from the trainer to them: one vLLM engine shared
by every phase, a phase's own hf engine, and the link each `train.sync` setting makes (in-process, a directory,
HTTP, engine servers behind a relay or router, a broadcast group, shared memory, SGLang)."""

from __future__ import annotations

import asyncio
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from furlong.build.training import DTYPES, lora_spec, policy_model, rollout_fp8
from furlong.config import Config, ConfigError, TrainConfig
from furlong.engine.factory import make_engine
from furlong.engine.hf import HFEngine
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router, RouterSettings
from furlong.model.fp8 import Fp8Spec, to_fp8_engine
from furlong.model.loading import load_model
from furlong.sync.handover import Arena
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay
from furlong.sync.transport import DirectoryTransport, HttpTransport, InProcessTransport, Transport, UpdateServer
from furlong.train.handover import HandoverLink
from furlong.train.weights import (
    Borrowed,
    BroadcastLink,
    DirectLink,
    PublishedLink,
    WeightLink,
    local_pull,
    start_engines,
)

if TYPE_CHECKING:  # Ray and openenv cost seconds to import; only runs that use them pay
    from furlong.cluster.session import RaySession


def shared_engine(cfg: Config, sft_dir: Path, run_path: Path):
    """train.engine=vllm: the run's one vLLM engine over the SFT model (it takes up to a minute to start),
    lent to each phase. With LoRA it runs a fresh adapter of the run's spec from the start (lora_B = 0: the
    identity, so eval_before sees the SFT model); RL's adapter-only pushes replace its tensors. Else None."""
    if cfg.train.engine != "vllm" or cfg.train.cluster == "ray":
        # on Ray, RL's vLLM servers are the engine actors' and the evals run on the driver's hf engine: a
        # vLLM here would take memory (or a GPU) outside the resources the run's placement groups reserved
        return None
    adapter = None
    if cfg.train.lora.enabled:
        from furlong.model.lora import save_adapter

        adapter = save_adapter(policy_model(cfg.train, sft_dir), run_path / "vllm-adapter")
    # in train.sync.engine_dtype, as the published weights: bfloat16 halves the engine's copy on a GPU
    s = cfg.train
    return make_engine("vllm", sft_dir, dtype=s.sync.engine_dtype, seed=s.seed, adapter=adapter, vllm=s.vllm)


def phase_engine(
    model_dir: Path, shared=None, prefix_cache_mb: float = 256, device: str = "cpu", deterministic: bool = False
):
    """A phase's engine: the run's `shared` one (lent: closing it leaves it running), else a new hf engine over
    the model in `model_dir`."""
    if shared is not None:
        return Borrowed(shared)
    return hf_engine(load_model(model_dir), prefix_cache_mb, device, deterministic)


def hf_engine(
    model,
    prefix_cache_mb: float,
    device: str = "cpu",
    deterministic: bool = False,
    routes: bool = False,
    fp8: Fp8Spec | None = None,
) -> HFEngine:
    """An hf engine over `model` (`fp8`: its Linears replaced by fp8 ones quantized from their weights)."""
    if fp8 is not None:
        model = to_fp8_engine(model, fp8)
    return HFEngine(model.to(device), eos_token_ids=(), prefix_cache_mb=prefix_cache_mb, deterministic=deterministic,
                    record_routes=routes)  # fmt: skip  # eos: end-of-turn stops; routes: MoE experts, for replay


def _fresh_dir(t: TrainConfig, run_path: Path) -> DirectoryTransport:
    # The run owns this directory: a resumed run republishes from its checkpoint's version, which may be
    # older than files the killed run left, so they go.
    root = t.sync.dir or run_path / "weights"
    shutil.rmtree(root, ignore_errors=True)
    return DirectoryTransport(root, keep=t.sync.keep)


async def weight_link(
    cfg: Config, run_path: Path, sft_dir: Path, shared=None, cluster: RaySession | None = None
) -> WeightLink:
    """RL's rollout engine and the link that keeps its weights current (train.engine, train.sync; with
    train.cluster=ray, engine actors)."""
    t, s = cfg.train, cfg.train.sync

    def publisher(transport: Any, fp8: Fp8Spec | None = None) -> Publisher:
        return Publisher(
            transport, full_every=s.full_every, engine_dtype=DTYPES[s.engine_dtype], momentum=s.momentum, fp8=fp8
        )

    if cluster is not None:  # every train.engine: each actor's relay loads its engine (hf, vllm, sglang)
        import furlong.build.cluster as ray_build

        published = None if s.transport == "shared" else _fresh_dir(t, run_path)
        return await ray_build.engine_link(cfg, cluster, sft_dir, published, publisher, lora_spec(t), run_path)
    if t.engine == "sglang":
        return await _sglang_link(cfg, run_path, sft_dir)
    hf = t.hf

    def local() -> tuple[Any, Fp8Spec | None]:
        """The in-process engine and, with train.sync.quantize=fp8, the weights it holds in fp8."""
        if shared is not None:
            return Borrowed(shared), None
        model = policy_model(t, sft_dir)
        fp8 = rollout_fp8(t, model)
        return hf_engine(model, hf.prefix_cache_mb, hf.device, hf.deterministic, t.records_routes, fp8), fp8

    if s.transport == "direct":
        return DirectLink(*local())
    if s.engine == "inprocess":
        engine, fp8 = local()
        transport: Transport = InProcessTransport() if s.transport == "inprocess" else _fresh_dir(t, run_path)
        token = secrets.token_urlsafe(24)  # the update server answers only this run's relays
        served = UpdateServer(transport, token=token) if s.transport == "http" else None  # type: ignore[arg-type]
        relay = Relay(HttpTransport(served.url, token=token) if served else transport, engine)

        async def cleanup_local() -> None:
            await engine.close()
            if served:
                served.close()

        return PublishedLink(engine, publisher(transport, fp8), lambda: local_pull(relay), cleanup_local)
    if s.transport == "broadcast":
        return await _broadcast_link(cfg, run_path, sft_dir)
    if s.transport == "shared":
        return await _shared_link(cfg, run_path, sft_dir)
    return await _engine_processes_link(cfg, run_path, sft_dir, publisher)


async def _engine_processes_link(
    cfg: Config, run_path: Path, sft_dir: Path, publisher: Callable[[Any], Publisher]
) -> PublishedLink:
    """train.sync.servers engine processes, each pulling published weights from a fresh directory (over an
    UpdateServer with train.sync.transport=http)."""
    t, s = cfg.train, cfg.train.sync
    directory = _fresh_dir(t, run_path)
    token = secrets.token_urlsafe(24)
    server = UpdateServer(directory, token=token) if s.transport == "http" else None
    processes = await start_engines(
        s.servers,
        sft_dir,
        server.url if server else str(directory.root),
        run_path,
        t.torch_threads,
        lora_spec(t),
        t.hf.prefix_cache_mb,
        token if server else None,
        engine_token=token,
    )
    remote, _members = _remote_engines(processes, token)

    async def cleanup_remote() -> None:
        await _stop_engines(remote, processes)
        if server:
            server.close()

    return PublishedLink(remote, publisher(directory), remote.sync, cleanup_remote)


def _remote_engines(
    processes: list[EngineProcess], token: str, settings: RouterSettings = RouterSettings()
) -> tuple[RemoteEngine | Router, list[RemoteEngine]]:
    """Clients of the engine processes: one is served directly, several sit behind a router."""
    members = [RemoteEngine(p.url, token=token) for p in processes]
    return (members[0] if len(members) == 1 else Router(members, settings)), members


async def _stop_engines(remote: RemoteEngine | Router, processes: list[EngineProcess]) -> None:
    await remote.close()
    await asyncio.gather(*(asyncio.to_thread(p.stop) for p in processes))


async def _engines_without_relay(
    cfg: Config, run_path: Path, sft_dir: Path
) -> tuple[str, list[EngineProcess], RemoteEngine | Router, list[RemoteEngine]]:
    """`train.sync.servers` engine servers that the link itself keeps current: the run's token, the processes,
    the engine (a router over several) and its members. The link takes a lost engine out and puts it back
    once it has loaded the live weights (readmit_after=0: there is no relay to catch up from)."""
    t = cfg.train
    token = secrets.token_urlsafe(24)  # the engines answer only this run
    processes = await start_engines(
        t.sync.servers, sft_dir, None, run_path, t.torch_threads, lora_spec(t), t.hf.prefix_cache_mb, engine_token=token
    )
    remote, members = _remote_engines(processes, token, RouterSettings(readmit_after=0))
    return token, processes, remote, members


async def _broadcast_link(cfg: Config, run_path: Path, sft_dir: Path) -> BroadcastLink:
    """train.sync.transport=broadcast: engine servers without a relay, joined to the trainer's group."""
    s = cfg.train.sync
    token, processes, remote, members = await _engines_without_relay(cfg, run_path, sft_dir)
    return await BroadcastLink.open(
        remote,
        members,
        address=s.master_address,
        backend=s.backend,
        dtype=DTYPES[s.engine_dtype],
        bucket_bytes=int(s.bucket_mb * 2**20),
        secret=token,
        cleanup=lambda: _stop_engines(remote, processes),
    )


async def _shared_link(cfg: Config, run_path: Path, sft_dir: Path) -> HandoverLink:
    """train.sync.transport=shared: engine servers on this host without a relay, each handed this process's
    copy of the weights in shared memory."""
    _, processes, remote, members = await _engines_without_relay(cfg, run_path, sft_dir)
    return HandoverLink(
        remote,
        members,
        arena=Arena("cpu", DTYPES[cfg.train.sync.engine_dtype]),
        cleanup=lambda: _stop_engines(remote, processes),
    )


async def _sglang_link(cfg: Config, run_path: Path, sft_dir: Path) -> DirectLink:
    """An SGLang server (started or attached, train.sglang) that loads each step's full weights itself."""
    if cfg.train.lora.enabled or cfg.train.sync.transport != "direct":
        raise ConfigError(
            "train.engine=sglang supports full-weight updates only: set train.lora.enabled=false "
            "and train.sync.transport=direct (the server loads each step's checkpoint)"
        )
    engine = await asyncio.to_thread(
        make_engine, "sglang", sft_dir, seed=cfg.train.seed, sglang=cfg.train.sglang, work_dir=run_path / "sglang"
    )
    return DirectLink(engine)  # any Engine with update_weights
