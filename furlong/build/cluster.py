"""Builders for `train.cluster: ray` (furlong.cluster): the run's Ray session, the RL trainer in its actor,
RL's engine actors behind the same router and weight link as local mode's engine processes, and a distillation
teacher's engine actor (train.distill.teacher.engine hf|vllm)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from pathlib import Path

from furlong.cluster.engines import EngineActors, EngineSpec
from furlong.cluster.ranks import RayRanks
from furlong.cluster.sandboxes import HostSpec, SandboxHosts
from furlong.cluster.session import RaySession, Roles
from furlong.cluster.trainer import RayTrainer
from furlong.config import Config, TrainConfig
from furlong.engine.remote import RemoteEngine
from furlong.engine.router import Router, RouterSettings
from furlong.sync.broadcast import DTYPES
from furlong.sync.handover import Arena
from furlong.sync.publish import Publisher
from furlong.sync.transport import DirectoryTransport, UpdateServer
from furlong.train.handover import HandoverLink
from furlong.train.protocol import Trainer
from furlong.train.ranks import WorkerSpec
from furlong.train.weights import PublishedLink


def session(t: TrainConfig) -> RaySession | None:
    """train.cluster=ray: Ray started (or joined) and the run's placement groups ready; else None."""
    if t.cluster != "ray":
        return None
    r = t.ray
    ranks = t.fsdp2.world_size if t.trainer == "fsdp2" else 1
    roles = Roles(
        engines=r.engines,
        engine_cpus=r.engine_cpus,
        trainer_cpus=r.trainer_cpus,
        placement=r.placement,
        trainer_ranks=ranks,
        trainer_gpus=r.trainer_gpus,
        engine_gpus=r.engine_gpus,
        sandbox_hosts=r.sandbox_hosts,
        sandbox_cpus=r.sandbox_host_cpus,
        teachers=int(t.distill.on and t.distill.teacher.engine != "trainer"),
    )
    return RaySession(roles, address=r.address, num_cpus=r.num_cpus, timeout_s=r.start_timeout_s)


def sandbox_hosts(cluster: RaySession, cfg: Config) -> SandboxHosts:
    """train.ray.sandbox_hosts host actors, serving sandboxes with the run's sandbox.* and images.* settings
    (as a bwrap host: the run's backend, remote, is how the driver reaches them)."""
    r = cfg.train.ray
    settings = {
        "sandbox": cfg.sandbox.model_dump(mode="json", exclude={"backend", "hosts", "host_token_file"}),
        "images": cfg.images.model_dump(mode="json"),
    }
    spec = HostSpec(capacity=r.sandbox_host_capacity, settings=settings, token=secrets.token_urlsafe(32))
    return SandboxHosts(cluster, spec, r.sandbox_hosts, cpus=r.sandbox_host_cpus)


def trainer(cluster: RaySession, make: Callable[[], Trainer], t: TrainConfig) -> RayTrainer:
    """train.sync.transport=shared: the actor hands its weights over from an arena on the engines' device
    (CUDA where both the trainer and the engines hold GPUs, else this host's shared memory)."""
    arena = None
    if t.sync.transport == "shared":
        on_gpu = t.ray.trainer_gpus > 0 and t.ray.engine_gpus > 0
        arena = Arena("cuda" if on_gpu else "cpu", DTYPES[t.sync.engine_dtype])
    return RayTrainer(cluster, make, threads=t.torch_threads, arena=arena)


def ranks(cluster: RaySession, spec: WorkerSpec, t: TrainConfig) -> RayRanks:
    """train.trainer=fsdp2 on Ray: a rank actor in each of the session's trainer bundles."""
    slots = [cluster.slot("trainer", rank) for rank in range(t.fsdp2.world_size)]
    return RayRanks(
        spec,
        t.fsdp2.world_size,
        cpus=t.ray.trainer_cpus,
        gpus=t.ray.trainer_gpus,
        timeout_s=t.fsdp2.timeout_s,
        slots=slots,
    )


async def engine_link(
    cfg: Config,
    cluster: RaySession,
    sft_dir: Path,
    directory: DirectoryTransport | None,
    publisher: Callable[[DirectoryTransport], Publisher],
    lora: dict | None,
    run_path: Path | None = None,
) -> PublishedLink | HandoverLink:
    """RL's engine actors (train.engine: hf, vllm or sglang in each), pulling from `directory`
    (train.sync.transport=directory: every node must see it), handed the trainer actor's weights in shared
    memory (shared: colocated; `directory` None), or, for any other transport, pulling from an UpdateServer
    over `directory`; one is served directly, several via a Router. `run_path`: where engine I keeps its
    files (engine-I/: an SGLang server's log and staged updates)."""
    t = cfg.train
    token = secrets.token_urlsafe(24)
    shared = directory is None
    server = (
        None
        if directory is None or t.sync.transport == "directory"
        else UpdateServer(directory, host=cluster.serve_host, token=token)
    )
    updates = None if directory is None else server.url if server else str(directory.root)  # None: no relay
    spec = _engine_spec(cfg, sft_dir, updates, lora, token, relayed=server is not None)
    try:
        actors = await asyncio.to_thread(
            EngineActors,
            cluster,
            spec,
            t.ray.engines,
            cpus=t.ray.engine_cpus,
            max_restarts=t.ray.max_restarts,
            gpus=t.ray.engine_gpus,
            work_root=run_path,
        )
    except BaseException:
        if server:
            server.close()
        raise
    engines = [RemoteEngine(u, token=token) for u in actors.urls]
    # shared: the link puts a lost engine back once it has loaded the live weights (no relay to catch up with)
    settings = RouterSettings(readmit_after=0) if shared else RouterSettings()
    remote = engines[0] if len(engines) == 1 else Router(engines, settings)

    async def cleanup() -> None:
        await remote.close()
        await asyncio.to_thread(actors.stop)
        if server:
            server.close()

    if shared:  # the trainer actor's arena: a link given other tensors copies them into its own (CPU) one
        return ActorHandoverLink(
            remote, engines, arena=Arena("cpu", DTYPES[t.sync.engine_dtype]), cleanup=cleanup, actors=actors
        )
    assert directory is not None
    return ActorLink(remote, publisher(directory), remote.sync, cleanup, actors)


def _engine_spec(
    cfg: Config, sft_dir: Path, updates: str | None, lora: dict | None, token: str, relayed: bool
) -> EngineSpec:
    """What each engine actor starts from: `updates` is where it pulls weights (None: handed them in shared
    memory); `relayed` (an UpdateServer serves them) means it pulls with `token` too."""
    t = cfg.train
    return EngineSpec(
        sft_dir,
        updates,
        threads=t.torch_threads,
        prefix_cache_mb=t.hf.prefix_cache_mb,
        lora=lora,
        updates_token=token if relayed else None,
        engine_token=token,
        device="cuda" if t.ray.engine_gpus > 0 else "cpu",
        kind=t.engine,
        seed=t.seed,
        sglang=t.sglang if t.engine == "sglang" else None,
        vllm=t.vllm if t.engine == "vllm" else None,
    )


class ActorLink(PublishedLink):
    """A published link whose engines are Ray actors (`actors`: their handles and processes)."""

    def __init__(self, engine, publisher: Publisher, pull, cleanup, actors: EngineActors) -> None:
        super().__init__(engine, publisher, pull, cleanup)
        self.actors = actors


class ActorHandoverLink(HandoverLink):
    """A handover link whose engines are Ray actors (`actors`: their handles and processes)."""

    def __init__(self, engine, members, *, arena: Arena, cleanup, actors: EngineActors) -> None:
        super().__init__(engine, members, arena=arena, cleanup=cleanup)
        self.actors = actors


class ActorEngine(RemoteEngine):
    """The engine server of one engine actor (`actors`), reached over HTTP; close() stops the actor too."""

    def __init__(self, actors: EngineActors, token: str) -> None:
        super().__init__(actors.urls[0], token=token)
        self.actors = actors

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(self.actors.stop)


async def teacher_engine(t: TrainConfig, cluster: RaySession, path: Path) -> ActorEngine:
    """train.distill.teacher.engine hf|vllm on Ray: one engine actor of that kind in the session's teacher
    bundle (train.ray.engine_cpus/engine_gpus, as a rollout engine's), loaded with the teacher's checkpoint
    `path` and never updated (no relay: a served teacher is frozen); Ray restarts it (train.ray.max_restarts)
    at the same URL, and while it is down its episodes fail their term (furlong.train.distill_engine)."""
    token = secrets.token_urlsafe(24)
    spec = EngineSpec(
        path,
        None,
        threads=t.torch_threads,
        prefix_cache_mb=t.hf.prefix_cache_mb,
        engine_token=token,
        device="cuda" if t.ray.engine_gpus > 0 else "cpu",
        kind=t.distill.teacher.engine,
        seed=t.seed,
    )
    actors = await asyncio.to_thread(
        EngineActors,
        cluster,
        spec,
        1,
        cpus=t.ray.engine_cpus,
        max_restarts=t.ray.max_restarts,
        gpus=t.ray.engine_gpus,
        role="teacher",
    )
    return ActorEngine(actors, token)
