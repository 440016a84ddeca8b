"""Builders for a training run: its pieces (tokenizer, sandboxes, tasks), the trainer, the scheduler (the
rollout engines and their weight link: furlong.build.links). Every class built here takes plain arguments."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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
from furlong.envs.base import EnvSource, EnvSpec
from furlong.metrics.run import RunDir
from furlong.metrics.wandb_log import WandbLog
from furlong.model.fp8 import Fp8Spec, fake_quantize, fp8_targets
from furlong.model.loading import frozen_model, load_model, load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.model.toolcall import tool_format
from furlong.rollout.groups import Rollouts
from furlong.rollout.scheduler import GroupStream, Scheduler
from furlong.sandbox.base import SandboxBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.pool import StoreImages
from furlong.sandbox.remote.hosts import Hosts
from furlong.sandbox.remote.images import HostImages
from furlong.train.distill import Teacher, TeacherSpec, TokenizerMismatch, check_tokenizers
from furlong.train.distill_engine import EngineTeacher, ServedTeacher
from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer
from furlong.train.protocol import Trainer
from furlong.train.ranks import LocalRanks, RankGroup
from furlong.train.trainer import GRPOConfig, LocalTrainer

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


def rollout_fp8(t: TrainConfig, model) -> Fp8Spec | None:
    """train.sync.quantize=fp8: the weights of `model` (the policy, as loaded) the rollout engine holds in fp8."""
    return fp8_targets(model, t.sync.fp8_block) if t.sync.quantize == "fp8" else None


def local_trainer(
    t: TrainConfig, sft_dir: Path, config: GRPOConfig, demos: list, hints: dict[str, str] | None = None
) -> LocalTrainer:
    device = torch.device(t.device)
    policy = policy_model(t, sft_dir, seed=t.seed).to(device)
    if t.sync.quantized_forward:  # the trainer's logprobs through the rollout engine's fp8 weights
        fake_quantize(policy, fp8_targets(policy, t.sync.fp8_block))
    ref = frozen_model(sft_dir, t.model.frozen_dtype).to(device) if t.rl.kl_coef > 0 else None  # type: ignore[arg-type]  # transformers' wrapped .to() misleads mypy
    return LocalTrainer(policy, config, ref_model=ref, demos=demos, teacher=teacher(t, sft_dir, device, hints or {}))


def teacher(t: TrainConfig, sft_dir: Path, device: torch.device, hints: dict[str, str]) -> Teacher | None:
    """train.distill's teacher on the trainer's device (furlong.train.distill.teacher_for); None when off."""
    spec = teacher_spec(t, sft_dir, hints)
    return None if spec is None else spec.build(sft_dir, grpo_config(t), device, load_model)


def teacher_spec(t: TrainConfig, sft_dir: Path, hints: dict[str, str]) -> TeacherSpec | None:
    """train.distill's teacher as values (None when off); teacher.frozen: the SFT checkpoint, as RL starts."""
    if not t.distill.on or t.distill.teacher.engine != "trainer":
        return None
    d = t.distill.teacher
    return TeacherSpec(
        sft_dir if d.frozen else d.path, d.system_prompt, tuple(sorted(hints.items())), t.model.frozen_dtype
    )


async def engine_teacher(
    t: TrainConfig, sft_dir: Path, hints: dict[str, str], cluster: RaySession | None = None
) -> EngineTeacher | None:
    """train.distill.teacher.engine hf|vllm: one more engine of that kind, in this process (vllm: its engine
    core process), or on `cluster` (train.cluster=ray) an engine actor in the run's teacher bundle, loaded with
    the teacher's checkpoint (teacher.frozen: the SFT checkpoint), scoring for the trainer; None when the
    teacher lives with the trainer."""
    d = t.distill.teacher
    if not t.distill.on or d.engine == "trainer":
        return None
    path = sft_dir if d.frozen else d.path
    assert path is not None  # config: an engine teacher is a checkpoint or a frozen self-teacher
    served = ServedTeacher(d.engine, Path(path), d.system_prompt, tuple(sorted(hints.items())))
    if cluster is not None:
        import furlong.build.cluster as ray_build  # imports Ray: only where the run is on it

        actor = await ray_build.teacher_engine(t, cluster, served.path)
        pid = (await asyncio.to_thread(actor.actors.pids))[0]
        out = EngineTeacher(served.renderer(sft_dir, grpo_config(t)), actor)
        out.where = f"a Ray engine actor (pid {pid}) in the run's teacher bundle, at {actor.url}"
        return out
    engine = await asyncio.to_thread(make_engine, d.engine, served.path, seed=t.seed)
    return EngineTeacher(served.renderer(sft_dir, grpo_config(t)), engine)


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
        frozen_dtype=t.model.frozen_dtype,
        expert_parallel=t.fsdp2.expert_parallel,
    )
    if cluster is None:
        return FSDP2Trainer(LocalRanks(spec, ws, timeout_s=t.fsdp2.timeout_s), spec)
    import furlong.build.cluster as ray_build

    ranks: RankGroup = ray_build.ranks(cluster, spec, t)
    return FSDP2Trainer(ranks, spec)


def lora_spec(t: TrainConfig) -> dict | None:
    lo = t.lora
    return {"rank": lo.rank, "alpha": lo.alpha, "targets": list(lo.targets)} if lo.enabled else None


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
