"""`train`: the run's roles, families and the checks that span its nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from furlong.config.base import BUNDLED_TASKS, _Node
from furlong.config.distill import DistillConfig
from furlong.config.engines import HFEngineConfig, RayConfig, SGLangConfig, SyncConfig, VLLMConfig
from furlong.config.env import (
    EnvConfig,
    LogConfig,
    TrainEvalConfig,
)
from furlong.config.policy import (
    DEFAULT_FAMILIES,
    AgentConfig,
    FSDP2Config,
    LoraConfig,
    ModelConfig,
    MoEConfig,
    RLConfig,
    SFTConfig,
)


class TrainConfig(_Node):
    tasks: Path = Field(BUNDLED_TASKS, description="the directory that holds train.families")
    families: tuple[str, ...] = Field(
        DEFAULT_FAMILIES,
        description="task families (directories under train.tasks) that SFT, RL and the held-out evals use",
    )
    run_dir: Path | None = Field(None, description="null: runs/<date-time>")
    seed: int = Field(0, description="the run's seed: group order, minibatch shuffles, SFT order, LoRA init")
    engine: Literal["hf", "vllm", "sglang"] = Field(
        "hf",
        description="hf (in-process); vllm: rollouts and evals (the vllm extra; furlong.engine.vllm); "
        "sglang: RL rollouts on an SGLang server, evals stay on hf (train.sglang)",
    )
    sglang: SGLangConfig = Field(SGLangConfig(), description="train.engine=sglang: the server")
    vllm: VLLMConfig = Field(VLLMConfig(), description="train.engine=vllm: its memory")
    cluster: Literal["local", "ray"] = Field(
        "local",
        description="local: every role in this process (or engine processes, train.sync.engine); "
        "ray: the RL trainer and engines as Ray actors (train.ray; their count is "
        "train.ray.engines, train.sync.engine and servers are not used; each actor runs "
        "train.engine's server: hf, vllm or sglang)",
    )
    ray: RayConfig = Field(RayConfig(), description="train.cluster=ray: the cluster, its placement and resources")
    torch_threads: int = Field(1, ge=1, description="1 is fastest for the tiny model on a shared 2-core box")
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where the trainer keeps and trains the policy "
        "(and its KL reference, and the SFT warm start: on Ray only if the driver's node "
        "has a GPU too, else on its CPU)",
    )
    trainer: Literal["local", "fsdp2"] = Field(
        "local",
        description="local: the policy in this process; fsdp2: sharded over train.fsdp2.world_size rank processes",
    )
    fsdp2: FSDP2Config = Field(FSDP2Config(), description="train.trainer=fsdp2: its ranks")
    model: ModelConfig = Field(ModelConfig(), description="the starting checkpoint")
    agent: AgentConfig = Field(AgentConfig(), description="the agent loop's limits and prompt")
    sft: SFTConfig = Field(SFTConfig(), description="the SFT warm-start")
    rl: RLConfig = Field(RLConfig(), description="GRPO")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters")
    moe: MoEConfig = Field(MoEConfig(), description="MoE routing replay and the router's load-balancing loss")
    distill: DistillConfig = Field(
        DistillConfig(), description="on-policy distillation from a teacher (docs/distill.md)"
    )
    sync: SyncConfig = Field(SyncConfig(), description="weight sync to the rollout engine")
    hf: HFEngineConfig = Field(HFEngineConfig(), description="the in-process hf engine")
    eval: TrainEvalConfig = Field(TrainEvalConfig(), description="the held-out evals before and after RL")
    env: EnvConfig = Field(EnvConfig(), description="your own environment, tools and reward functions")
    log: LogConfig = Field(LogConfig(), description="metrics beside metrics.jsonl and TensorBoard")

    @model_validator(mode="after")
    def _vllm_engine_supports(self) -> TrainConfig:
        if self.engine == "vllm" and self.sync.engine == "server":
            raise ValueError(
                "train.engine=vllm runs vLLM's own engine process: set train.sync.engine=inprocess "
                "(sync.engine=server is the hf engine server)"
            )
        return self

    @model_validator(mode="after")
    def _fp8_rollout_supports(self) -> TrainConfig:
        # The in-process hf engine holds fp8 weights and answers their checksum; the local trainer fake-quantizes.
        s = self.sync
        if s.quantize == "fp8" and (
            self.engine != "hf" or s.engine != "inprocess" or s.transport in ("broadcast", "shared")
            or self.cluster != "local" or self.trainer != "local" or self.lora.enabled
        ):  # fmt: skip
            raise ValueError(
                f"train.sync.quantize=fp8 runs the in-process hf engine on published fp8 weights: it needs "
                f"train.engine=hf, train.sync.engine=inprocess, train.sync.transport in direct/inprocess/directory/"
                f"http, train.cluster=local, train.trainer=local and train.lora.enabled=false; got train.engine="
                f"{self.engine}, train.sync.engine={s.engine}, train.sync.transport={s.transport}, train.cluster="
                f"{self.cluster}, train.trainer={self.trainer}, train.lora.enabled={self.lora.enabled}"
            )
        return self

    @model_validator(mode="after")
    def _deterministic_engine_is_in_process(self) -> TrainConfig:
        # Only the in-process hf engine has the mode; elsewhere the key would promise what the run lacks.
        if self.hf.deterministic and (self.engine != "hf" or self.sync.engine == "server" or self.cluster == "ray"):
            raise ValueError(
                f"train.hf.deterministic: only the in-process hf engine has it (train.engine=hf, "
                f"train.sync.engine=inprocess, train.cluster=local); got train.engine={self.engine}, "
                f"train.sync.engine={self.sync.engine}, train.cluster={self.cluster}"
            )
        return self

    @model_validator(mode="after")
    def _routes_are_recorded(self) -> TrainConfig:
        # Only the in-process hf engine records routes, and only the local trainer's replay is tested.
        if self.moe.routing_replay == "on" and not self.records_routes:
            raise ValueError(
                f"train.moe.routing_replay=on: only the in-process hf engine records the experts it chose "
                f"(train.engine=hf, train.sync.engine=inprocess, train.cluster=local, train.trainer=local); got "
                f"train.engine={self.engine}, train.sync.engine={self.sync.engine}, train.cluster={self.cluster}, "
                f"train.trainer={self.trainer}"
            )
        return self

    @property
    def records_routes(self) -> bool:
        """Whether the rollout engine records MoE routes for replay (an MoE model's; docs/models.md)."""
        in_process = self.engine == "hf" and self.sync.engine == "inprocess" and self.cluster == "local"
        return self.moe.routing_replay != "off" and in_process and self.trainer == "local"

    @model_validator(mode="after")
    def _ray_cluster_supports(self) -> TrainConfig:
        if self.cluster == "ray" and self.engine != "hf" and self.lora.enabled:
            # the actors' vLLM and SGLang servers take full-weight updates only (their LoRA paths are not wired)
            raise ValueError(
                f"train.cluster=ray with train.engine={self.engine} loads full weights into each "
                f"engine actor's server: set train.lora.enabled=false, or train.engine=hf"
            )
        if self.cluster == "ray" and self.engine == "sglang" and self.sglang.url is not None:
            raise ValueError(
                "train.cluster=ray starts an SGLang server in each engine actor: drop train.sglang.url "
                "(attaching to a running server is local mode's)"
            )
        if self.cluster == "ray" and (self.device == "cuda") != (self.ray.trainer_gpus > 0):
            raise ValueError(
                f"train.cluster=ray: train.device={self.device} needs train.ray.trainer_gpus "
                f"{'> 0 (the trainer actor must hold a GPU)' if self.device == 'cuda' else '= 0'} "
                f"(got {self.ray.trainer_gpus:g})"
            )
        if self.cluster == "ray" and self.sync.transport == "broadcast":
            raise ValueError(
                "train.cluster=ray: engine actors take updates from files, HTTP or shared memory "
                "(train.sync.transport=directory, http or shared); the broadcast transport is for "
                "train.sync.engine=server"
            )
        return self

    @model_validator(mode="after")
    def _shared_memory_reaches_the_engines(self) -> TrainConfig:
        """train.sync.transport=shared: every engine is a process on the host that holds the weights."""
        if self.sync.transport != "shared":
            return self
        if self.cluster == "local" and (self.sync.engine != "server" or self.engine != "hf"):
            raise ValueError(
                "train.sync.transport=shared hands the weights to engine server processes on this host: "
                "set train.sync.engine=server (with train.engine=hf); in one process, transport=direct "
                "already copies them in place"
            )
        if self.cluster == "ray" and self.ray.placement != "colocated":
            raise ValueError(
                "train.sync.transport=shared needs the engines on the trainer's node: set "
                "train.ray.placement=colocated, or a transport that crosses nodes (http)"
            )
        if self.cluster == "ray" and self.trainer == "fsdp2" and self.ray.address is not None:
            raise ValueError(
                "train.sync.transport=shared with train.trainer=fsdp2: the driver holds the gathered "
                "weights, so it must share the engines' node; joining a cluster (train.ray.address) "
                "cannot promise that: use transport=http there"
            )
        return self

    @model_validator(mode="after")
    def _distill_supports(self) -> TrainConfig:
        d = self.distill
        if not d.on:
            return self
        if d.teacher.system_prompt is not None and self.agent.harness.command is not None:
            raise ValueError(
                "train.distill.teacher.system_prompt with train.agent.harness.command: a harness writes its own "
                "prompt, which furlong cannot re-render under the teacher's; use train.distill.teacher.path"
            )
        if d.teacher.engine == "vllm" and self.rl.temperature != 1.0:
            raise ValueError(
                f"train.distill.teacher.engine=vllm scores at temperature 1 only (vLLM's prompt logprobs are "
                f"untempered), but train.rl.temperature is {self.rl.temperature}; use engine hf or trainer"
            )
        # A group whose rewards are all equal still has a teacher's per-token signal: filtering it would drop
        # exactly the episodes distillation learns from.
        if "filter_zero_variance" in self.rl.model_fields_set and self.rl.filter_zero_variance:
            raise ValueError(
                f"train.rl.filter_zero_variance: true drops groups whose rewards are equal, but with "
                f"train.distill.mode {d.mode} their tokens still carry the teacher's signal; drop the key "
                "(it is false under distillation)"
            )
        object.__setattr__(self, "rl", self.rl.model_copy(update={"filter_zero_variance": False}))
        return self

    @model_validator(mode="after")
    def _family_subsets_known(self) -> TrainConfig:
        # the default's demonstrated/reward-only split is about the default's families: a recipe that picks
        # its own families demonstrates them all, and RL draws from them all, unless it says otherwise
        own = "families" in self.model_fields_set
        if self.env.family() is not None:
            self._own_env_families(own)
            own = True
        if own and "families" not in self.sft.model_fields_set:
            object.__setattr__(self, "sft", self.sft.model_copy(update={"families": None}))
        if (own or "families" in self.sft.model_fields_set) and "families" not in self.rl.model_fields_set:
            object.__setattr__(self, "rl", self.rl.model_copy(update={"families": None}))
        for key, chosen in (("sft", self.sft.families), ("rl", self.rl.families)):
            unknown = [f for f in chosen or () if f not in self.families]
            if unknown:
                raise ValueError(f"train.{key}.families: {unknown} not in train.families {list(self.families)}")
        return self

    def _own_env_families(self, own: bool) -> None:
        """A Python environment or a prompt dataset is the run's one family. Without demonstrations (a Python
        environment without train.env.demonstrations, a dataset without answer_field) there is no SFT (train.sft.families empty,
        train.sft.epochs 0) and no demonstration anchor (train.rl.sft_coef 0)."""
        family, key = self.env.family(), "train.env.python" if self.env.python else "train.env.prompts"
        if own and self.families != (family,):
            raise ValueError(f"train.families: with {key} the run's one family is {family!r}; drop train.families")
        object.__setattr__(self, "families", (family,))
        if self.env.demonstrable():
            return
        what = (
            "a Python environment has no oracle demonstrations unless it gives its own "
            "(train.env.demonstrations: true, docs/environments.md)"
            if self.env.python
            else "the prompt dataset has no answers to demonstrate (train.env.prompts.answer_field)"
        )
        for name, value in (("families", self.sft.families), ("epochs", self.sft.epochs)):
            if name in self.sft.model_fields_set and value:
                raise ValueError(f"train.sft.{name}: {what}; drop it")
        if "sft_coef" in self.rl.model_fields_set and self.rl.sft_coef > 0:
            raise ValueError(f"train.rl.sft_coef: {what} for RL's anchor; drop it (it is 0 here)")
        object.__setattr__(self, "rl", self.rl.model_copy(update={"sft_coef": 0.0}))
        object.__setattr__(self, "sft", self.sft.model_copy(update={"families": (), "epochs": 0}))

    @model_validator(mode="after")
    def _openenv_has_no_demos(self) -> TrainConfig:
        if self.env.openenv and (self.sft.epochs or self.rl.sft_coef):
            raise ValueError(
                "train.env.openenv: an OpenEnv server has no oracle solutions to demonstrate; set "
                "train.sft.epochs=0 and train.rl.sft_coef=0 (start from a trained train.model.path)"
            )
        if self.env.openenv and "families" not in self.rl.model_fields_set:  # the default's are Harbor's
            object.__setattr__(self, "rl", self.rl.model_copy(update={"families": None}))
        return self

    def demonstrated(self) -> tuple[str, ...]:
        """The families SFT shows demonstrations of (none on an OpenEnv server)."""
        if self.env.openenv:
            return ()
        return self.families if self.sft.families is None else self.sft.families

    def reward_only(self) -> tuple[str, ...]:
        """The Harbor families RL learns from reward alone: no demonstration of them is ever shown."""
        if self.env.openenv:
            return ()  # the server's families are known only once it answers
        return tuple(f for f in self.families if f not in self.demonstrated())
