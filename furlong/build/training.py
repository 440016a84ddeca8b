"""Builders for a training run: its pieces (tokenizer, sandboxes, tasks), the trainer, the rollout engine and
its weight link, the scheduler. Every class built here takes plain arguments."""

from __future__ import annotations

import asyncio
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from furlong.agent.episode import AgentParams
from furlong.agent.harness import program
from furlong.build.environment import RunEnv, env_source, run_env
from furlong.build.sandbox import image_store, network_default, sandbox_backend
from furlong.config import Config, ConfigError, TrainConfig
from furlong.engine.factory import make_engine
from furlong.engine.hf import HFEngine
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router, RouterSettings
from furlong.envs.base import EnvSource, EnvSpec
from furlong.metrics.run import RunDir
from furlong.metrics.wandb_log import WandbLog
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.model.toolcall import tool_format
from furlong.rollout.groups import Rollouts
from furlong.rollout.scheduler import GroupStream, Scheduler
from furlong.sandbox.base import SandboxBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.pool import StoreImages
from furlong.sandbox.remote.hosts import Hosts
from furlong.sandbox.remote.images import HostImages
from furlong.sync.handover import Arena
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay
from furlong.sync.transport import DirectoryTransport, HttpTransport, InProcessTransport, Transport, UpdateServer
from furlong.train.distill import Teacher, TeacherSpec, TokenizerMismatch, check_tokenizers
from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer
from furlong.train.handover import HandoverLink
from furlong.train.protocol import Trainer
from furlong.train.ranks import LocalRanks, RankGroup
from furlong.train.trainer import GRPOConfig, LocalTrainer
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
    from furlong.cluster.sandboxes import SandboxHosts
    from furlong.cluster.session import RaySession

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Pieces:
    """What every phase of a run shares."""

    tokenizer: Any  # a transformers tokenizer
    backend: SandboxBackend
    store: ImageStore | HostImages
    env: RunEnv  # what each phase opens its episodes in; its image lookup is shared, so a Dockerfile that
    # fails to build is tried once per run
    train_tasks: Sequence[EnvSpec]  # Harbor tasks, a Python environment's instances, prompt rows, OpenEnv specs
    eval_tasks: Sequence[EnvSpec]
    params: AgentParams
    base_model: Path
    cluster: RaySession | None = None  # train.cluster=ray: the run's Ray cluster and placement groups
    hosts: SandboxHosts | None = None  # train.ray.sandbox_hosts: the host actors `backend` reaches

    def close(self) -> None:
        """What the pieces hold beyond the run's phases: sandbox host actors (stopped first, so each closes
        its sandboxes), then the Ray session (the other actors go with it)."""
        if self.hosts is not None:
            self.hosts.stop()
        if self.cluster is not None:
            self.cluster.close()


def check_devices(t: TrainConfig) -> None:
    """A CUDA device asked of this process (not of Ray actors, which get their own) must be here."""
    asked = [
        f"{key}=cuda"
        for key, device in (
            ("train.device", t.device if t.cluster == "local" else "cpu"),
            ("train.hf.device", t.hf.device),
        )
        if device == "cuda"
    ]
    if asked and not torch.cuda.is_available():
        raise ConfigError(
            f"{', '.join(asked)}: no CUDA device is visible to this process "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})"
        )


def pieces(cfg: Config) -> Pieces:
    t = cfg.train
    check_devices(t)
    base = t.model.path or init_tiny(seed=t.model.seed)
    tokenizer = load_tokenizer(base)
    tool_format(tokenizer, t.agent.tool_format)  # a format the template cannot use fails here, not per episode
    if t.distill.teacher.path is not None:  # ... and so does a teacher that cannot score the student's ids
        try:
            check_tokenizers(Path(base), t.distill.teacher.path, tokenizer)
        except TokenizerMismatch as e:
            raise ConfigError(str(e)) from None
    if t.agent.harness.command is not None:
        program(t.agent.harness.command)  # ... and so does a harness program that is not there
    cluster = ray_session(t)
    hosts = None
    try:
        if cluster is not None and t.ray.sandbox_hosts:
            import furlong.build.cluster as ray_build

            hosts = ray_build.sandbox_hosts(cluster, cfg)
        store, backend = run_sandboxes(cfg, hosts)
        images = StoreImages(store, backend)
        source: EnvSource
        if t.env.openenv:
            from furlong.build.openenv import openenv_environment, openenv_source

            source, sessions = openenv_source(cfg.openenv), openenv_environment(cfg.openenv)
        else:
            source, sessions = env_source(t, backend, network_default(cfg.sandbox)), None
        return Pieces(
            tokenizer=tokenizer,
            backend=backend,
            store=store,
            env=run_env(t.env, backend, images, sessions, store if isinstance(store, ImageStore) else None),
            train_tasks=source.instances("train"),
            eval_tasks=source.instances("heldout"),
            params=AgentParams.of(t.agent),
            base_model=Path(base),
            cluster=cluster,
            hosts=hosts,
        )
    except BaseException:
        if hosts is not None:
            hosts.stop()
        if cluster is not None:
            cluster.close()
        raise


def run_sandboxes(cfg: Config, hosts: SandboxHosts | None) -> tuple[ImageStore | HostImages, SandboxBackend]:
    """The image store and backend of the run's sandboxes: sandbox.* as configured, or the remote backend
    over the run's own sandbox host actors."""
    if hosts is None:
        store = image_store(cfg.sandbox, cfg.images)
        return store, sandbox_backend(cfg.sandbox, store)
    store = HostImages(Hosts(hosts.urls, hosts.token))
    return store, sandbox_backend(cfg.sandbox.model_copy(update={"backend": "remote"}), store)


def ray_session(t: TrainConfig) -> RaySession | None:
    """train.cluster=ray: the run's Ray session (furlong.build.cluster); else None, without importing Ray."""
    if t.cluster != "ray":
        return None
    import furlong.build.cluster as ray_build

    return ray_build.session(t)


def attach_loggers(t: TrainConfig, run: RunDir) -> None:
    """train.log: W&B beside the metrics.jsonl and TensorBoard events every run directory gets."""
    w = t.log.wandb
    if w.enabled:
        run.sinks.append(WandbLog(run.path, w.project, w.mode, w.dir, config=run.config()))


def grpo_config(t: TrainConfig) -> GRPOConfig:
    replay = t.moe.routing_replay if t.records_routes else "off"
    return replace(GRPOConfig.of(t.rl, seed=t.seed), distill_mode=t.distill.mode, distill_weight=t.distill.weight,
                   routing_replay=replay, moe_aux_coef=t.moe.aux_loss_coef)  # fmt: skip


def teacher_hints(t: TrainConfig, tasks: Sequence[EnvSpec]) -> dict[str, str]:
    """train.distill.teacher.hint=solution: each train task's oracle solution (solve.sh), by task id; tasks
    without one (a Python environment's, a prompt dataset's) get no hint."""
    if not t.distill.on or t.distill.teacher.hint != "solution":
        return {}
    found = {task.id: getattr(task, "solution", None) for task in tasks}
    return {k: Path(v).read_text() for k, v in found.items() if v is not None and Path(v).is_file()}


def policy_model(t: TrainConfig, sft_dir: Path, seed: int | None = 0):
    """The SFT model, wrapped with fresh LoRA adapters when train.lora is on (`seed`: their init)."""
    model = load_model(sft_dir)
    if not t.lora.enabled:
        return model
    from furlong.model.lora import LoraSpec, wrap_lora  # peft loads slowly: only LoRA runs need it

    return wrap_lora(model, LoraSpec(rank=t.lora.rank, alpha=t.lora.alpha, targets=t.lora.targets), seed=seed)


def trainer(
    t: TrainConfig,
    sft_dir: Path,
    demos: list,
    anchor: bool = True,
    cluster: RaySession | None = None,
    hints: dict[str, str] | None = None,
) -> Trainer:
    """The policy trainer (train.trainer) on train.device, in this process or (train.cluster=ray) in the
    session's actors; the KL reference is the SFT model itself (with LoRA too: fresh adapters start as the
    identity). `anchor` False: a finished RL phase, which trains no more. A distillation teacher
    (train.distill) is built beside the policy, in the actor on Ray; `hints`: its privileged hints by task."""
    config = grpo_config(t) if anchor else replace(grpo_config(t), sft_coef=0.0)
    demos = demos if anchor else []
    if t.trainer == "fsdp2":
        return fsdp2_trainer(t, sft_dir, config, demos, cluster, hints)
    if cluster is not None:
        import furlong.build.cluster as ray_build

        return ray_build.trainer(cluster, partial(local_trainer, t, sft_dir, config, demos, hints), t)
    return local_trainer(t, sft_dir, config, demos, hints)


def local_trainer(
    t: TrainConfig, sft_dir: Path, config: GRPOConfig, demos: list, hints: dict[str, str] | None = None
) -> LocalTrainer:
    device = torch.device(t.device)
    policy = policy_model(t, sft_dir, seed=t.seed).to(device)
    ref = load_model(sft_dir).to(device).requires_grad_(False) if t.rl.kl_coef > 0 else None  # type: ignore[arg-type]  # transformers' wrapped .to() misleads mypy
    return LocalTrainer(policy, config, ref_model=ref, demos=demos, teacher=teacher(t, sft_dir, device, hints or {}))


def teacher(t: TrainConfig, sft_dir: Path, device: torch.device, hints: dict[str, str]) -> Teacher | None:
    """train.distill's teacher on the trainer's device (furlong.train.distill.teacher_for); None when off."""
    spec = teacher_spec(t, sft_dir, hints)
    return None if spec is None else spec.build(sft_dir, grpo_config(t), device, load_model)


def teacher_spec(t: TrainConfig, sft_dir: Path, hints: dict[str, str]) -> TeacherSpec | None:
    """train.distill's teacher as values (None when off); teacher.frozen: the SFT checkpoint, as RL starts."""
    if not t.distill.on:
        return None
    d = t.distill.teacher
    return TeacherSpec(sft_dir if d.frozen else d.path, d.system_prompt, tuple(sorted(hints.items())))


def fsdp2_trainer(
    t: TrainConfig,
    sft_dir: Path,
    config: GRPOConfig,
    demos: list,
    cluster: RaySession | None = None,
    hints: dict[str, str] | None = None,
) -> Trainer:
    """train.fsdp2.world_size ranks, each building the policy (and train.distill's teacher) from `sft_dir`:
    processes on this host, or (train.cluster=ray) Ray actors placed in the run's cluster."""
    from furlong.model.lora import LoraSpec  # peft loads slowly: only LoRA runs need it

    ws = t.fsdp2.world_size
    if t.device == "cuda" and ws > torch.cuda.device_count():
        raise ConfigError(
            f"train.fsdp2.world_size: {ws} ranks need {ws} GPUs (one each); {torch.cuda.device_count()} visible"
        )
    lo = t.lora
    spec = FSDP2Spec(
        sft_dir,
        config,
        lora=LoraSpec(rank=lo.rank, alpha=lo.alpha, targets=lo.targets) if lo.enabled else None,
        lora_seed=t.seed,
        demos=tuple(demos),
        device=t.device,
        threads=t.torch_threads,
        teacher=teacher_spec(t, sft_dir, hints or {}),
    )
    if cluster is None:
        return FSDP2Trainer(LocalRanks(spec, ws, timeout_s=t.fsdp2.timeout_s), spec)
    import furlong.build.cluster as ray_build

    ranks: RankGroup = ray_build.ranks(cluster, spec, t)
    return FSDP2Trainer(ranks, spec)


def lora_spec(t: TrainConfig) -> dict | None:
    lo = t.lora
    return {"rank": lo.rank, "alpha": lo.alpha, "targets": list(lo.targets)} if lo.enabled else None


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
    return make_engine("vllm", sft_dir, seed=cfg.train.seed, adapter=adapter)


def phase_engine(
    model_dir: Path, shared=None, prefix_cache_mb: float = 256, device: str = "cpu", deterministic: bool = False
):
    """A phase's engine: the run's `shared` one (lent: closing it leaves it running), else a new hf engine over
    the model in `model_dir`."""
    if shared is not None:
        return Borrowed(shared)
    return hf_engine(load_model(model_dir), prefix_cache_mb, device, deterministic)


def hf_engine(
    model, prefix_cache_mb: float, device: str = "cpu", deterministic: bool = False, routes: bool = False
) -> HFEngine:
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

    def publisher(transport: Any) -> Publisher:
        return Publisher(transport, full_every=s.full_every, engine_dtype=DTYPES[s.engine_dtype], momentum=s.momentum)

    if cluster is not None:  # every train.engine: each actor's relay loads its engine (hf, vllm, sglang)
        import furlong.build.cluster as ray_build

        published = None if s.transport == "shared" else _fresh_dir(t, run_path)
        return await ray_build.engine_link(cfg, cluster, sft_dir, published, publisher, lora_spec(t), run_path)
    if t.engine == "sglang":
        return await _sglang_link(cfg, run_path, sft_dir)
    hf = t.hf

    def local() -> Any:
        if shared is not None:
            return Borrowed(shared)
        return hf_engine(policy_model(t, sft_dir), hf.prefix_cache_mb, hf.device, hf.deterministic, t.records_routes)

    if s.transport == "direct":
        return DirectLink(local())
    if s.engine == "inprocess":
        engine = local()
        transport: Transport = InProcessTransport() if s.transport == "inprocess" else _fresh_dir(t, run_path)
        token = secrets.token_urlsafe(24)  # the update server answers only this run's relays
        served = UpdateServer(transport, token=token) if s.transport == "http" else None  # type: ignore[arg-type]
        relay = Relay(HttpTransport(served.url, token=token) if served else transport, engine)

        async def cleanup_local() -> None:
            await engine.close()
            if served:
                served.close()

        return PublishedLink(engine, publisher(transport), lambda: local_pull(relay), cleanup_local)
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


def scheduler(
    t: TrainConfig, rollouts: Rollouts, tasks: Sequence[EnvSpec], start: int, cursor: dict | None, counted: int
) -> Scheduler:
    """The RL rollout side from step `start`. Sync and async are one loop: sync runs one step's groups at a time
    with zero lookahead, so the next step's episodes start only once this step's weights are in the engine.
    `cursor`/`counted`: where a resumed run's stream goes on, and the in-flight episodes its rows counted."""
    r = t.rl
    picked = tasks if r.families is None else [task for task in tasks if task.family in r.families]
    if not picked:
        raise ConfigError(
            f"train.rl.families: no train task is of {list(r.families or ())} (the train tasks' "
            f"families: {sorted({str(task.family) for task in tasks})})"
        )
    return Scheduler(
        rollouts,
        GroupStream(picked, r.tasks_per_step, r.group_size, t.seed),
        temperature=r.temperature,
        steps_left=r.steps - start,
        first_step=start,
        inflight=r.inflight_groups(),
        lookahead=0 if r.mode == "sync" else r.max_staleness,
        max_staleness=r.max_staleness,
        requeue=r.stale_policy == "requeue",
        cursor=cursor,
        counted=counted,
    )
