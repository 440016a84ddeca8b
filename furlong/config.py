"""One typed config tree: defaults here, a YAML recipe sets what differs, `key=value` overrides last.

An unknown key or a value of the wrong type is an error that names the key and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TASKS = REPO_ROOT / "tasks"
RECIPES = REPO_ROOT / "recipes"


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SandboxConfig(_Node):
    backend: Literal["bwrap", "remote"] = Field(
        "bwrap", description="the sandbox backend (bwrap: bubblewrap namespaces here; remote: on sandbox.hosts, "
                             "`furlong sandbox serve` hosts, which also build the images)")
    hosts: list[str] = Field([], description="backend=remote: the hosts' URLs (http://H:P); sandboxes go to the least "
                                             "loaded one that answers")
    host_token_file: Path | None = Field(None, description="backend=remote: the file holding the hosts' bearer "
                                         "token; null: the one `furlong sandbox serve` generates on loopback "
                                         "($FURLONG_CACHE/host-token)")
    host_uid: int = Field(61000, gt=0, description="unprivileged uid sandboxes run as when furlong runs as root")
    output_cap_bytes: int = Field(1 << 20, gt=0, description="stdout and stderr kept per command; the rest is "
                                  "cut, and the cut is marked")
    seccomp: bool = Field(True, description="the syscall filter (furlong.sandbox.seccomp): false turns it off for "
                          "every sandbox; true filters each sandbox whose task keeps [environment] seccomp = true "
                          "(the default)")
    debian_mirror: str = Field("http://deb.debian.org/debian", description="apt mirror for building the base image")


class ImagesConfig(_Node):
    """Base images pulled from registries (furlong.sandbox.registry; docs/images.md, "Base images from
    registries"), the Debian stand-ins for official images (furlong.sandbox.standins; docs/images.md,
    "Stand-ins"), and what builds and networked sandboxes borrow from the host (furlong.sandbox.egress)."""

    prefer_registry: bool = Field(False, description="pull the names furlong has stand-ins for (python:*, "
                                  "debian:bookworm...) from their registry too; env FURLONG_PREFER_REGISTRY=1")
    standins: Literal["nearest", "exact"] = Field(
        "nearest", description="a tag whose version Debian does not ship (python:3.12, node:22): nearest: the "
                               "stand-in with the nearest version, and its note says so; exact: a one-line error "
                               "naming the versions Debian has (Go always needs its exact release)")
    registry_auth_file: Path | None = Field(None, description="a containers-auth.json for private registries "
                                            "(skopeo --authfile); null: $REGISTRY_AUTH_FILE, else skopeo's defaults")
    pull_timeout_s: float = Field(1800.0, gt=0, description="one image pull")
    trust_host_ca: bool = Field(False, description="build steps and networked sandboxes trust the host's CA "
                                "certificates (host_ca_bundle, bound read-only; SSL_CERT_FILE, PIP_CERT... name it): "
                                "for TLS-intercepting proxies and internal mirrors. They then trust whatever the "
                                "host trusts, an interception CA included (docs/images.md)")
    host_ca_bundle: Path | None = Field(None, description="trust_host_ca: the PEM bundle; null: the one the host's "
                                        "pip and Python verify with (pip's cert, else SSL_CERT_FILE, else OpenSSL's)")
    package_mirrors: Literal["none", "host"] = Field(
        "none", description="host: build steps and networked sandboxes get the host pip's http(s) index settings "
                            "(PIP_INDEX_URL, pip.conf), its proxy variables and apt's proxy settings")


class OpenEnvConfig(_Node):
    """An OpenEnv environment server that episodes run on when train.env or eval.env is openenv
    (furlong.envs.openenv; docs/openenv.md). One WebSocket session per episode."""

    url: str | None = Field(None, description="the server's base URL (http://H:P or ws://H:P)")
    token_file: Path | None = Field(None, description="a file holding the bearer token the server wants "
                                    "(`furlong openenv serve`'s --token-file); null: send none")
    instances: dict[str, int] = Field({"train": 64, "heldout": 16}, description="most instances per split: the "
                                      "server's own tasks of that split where it lists them (its task API), else "
                                      "resets with seeds 0.. (train) and after the train seeds (heldout)")
    splits: dict[str, str] = Field({"train": "train", "heldout": "heldout"}, description="furlong's split -> "
                                   "the server's split name in its task API")
    instruction: str = Field("", description="the user message before the environment's first observation "
                             "(a furlong server's observation carries the task's instruction itself)")
    tool_name: str = Field("step", description="the one tool the model calls when the server lists no tools: "
                           "its arguments are an action of the server's /schema")
    agent_timeout_s: float = Field(600.0, gt=0, description="an episode's agent phase, where the server's "
                                   "task API gives none")
    connect_timeout_s: float = Field(30.0, gt=0, description="opening a session")
    message_timeout_s: float = Field(900.0, gt=0, description="one reset or step, the tests a furlong server "
                                     "runs at the end included; past it the session counts as lost")


class EvalConfig(_Node):
    env: Literal["harbor", "openenv"] = Field("harbor", description="harbor: tasks (eval.tasks) in sandboxes "
                                              "here; openenv: the server of the `openenv` section")
    tasks: Path = Field(BUNDLED_TASKS, description="a task, a task family, or a directory of them")
    agent: Literal["oracle", "noop", "model"] = Field(
        "oracle", description="oracle: the task's solution; noop: does nothing; model: eval.model in the training "
                              "agent loop (limits: train.agent.*)")
    model: Path | None = Field(None, description="--agent model: a local Hugging Face checkpoint directory")
    adapter: Path | None = Field(None, description="--agent model: a PEFT adapter directory applied to eval.model")
    engine: Literal["hf", "vllm"] = Field("hf", description="--agent model: the inference engine")
    samples: int = Field(1, ge=1, description="episodes per task (pass@k is reported for k = powers of 2 and this)")
    temperature: float = Field(1.0, ge=0, description="--agent model: sampling temperature (0: greedy)")
    seed: int = Field(0, description="--agent model: sampling seeds derive from this, the task and the sample")
    concurrency: int = Field(2, ge=1, description="episodes (sandboxes) at once")
    out: Path | None = Field(None, description="write one JSON line per episode here; null: none")
    split: Literal["train", "heldout", "all"] = Field("heldout", description="which instances of task families")
    per_family: int | None = Field(2, ge=1, description="instances of each task family; null for all")
    verifier_toolchain: bool = Field(False, description="stack uv, uvx and pytest on every task's image "
                                                        "(a task opts in alone with [furlong] verifier_toolchain)")


# Fixed-path families where the instruction's words pick the command: learnable by the 4M-parameter
# tiny model within the default budget (families that need names copied are not, yet). SFT shows
# demonstrations of the first two only; number-words asks for number-stats' commands in words never
# demonstrated, so RL must learn them from the verifier's reward (docs/training.md, "What RL learns from reward alone"). text-words,
# its transform-text twin, is left out: after SFT the tiny model never samples the right command for most
# of its wordings, so there is no reward to learn from. RL draws only number-words, so every group of a
# step is of the family that only reward can teach (3-5 of 16 when RL drew all three families), and the
# demonstration anchor (rl.sft_coef) keeps what SFT taught of the others (bench/results/rl_seeds.json).
DEFAULT_FAMILIES = ("number-stats", "transform-text", "number-words")
DEFAULT_SFT_FAMILIES = ("number-stats", "transform-text")
DEFAULT_RL_FAMILIES = ("number-words",)


class ModelConfig(_Node):
    path: Path | None = Field(None, description="a local Hugging Face checkpoint; null builds the tiny model")
    seed: int = Field(0, description="seed of the tiny model's initial weights (model.path null)")


DEFAULT_SYSTEM_PROMPT = ("You are an agent in a Linux terminal. Use the bash tool to complete the task. "
                         "When the task is done, reply without a tool call.")


class AgentConfig(_Node):
    """The multi-turn agent loop (furlong.agent.episode) of training, its evals and `furlong eval --agent model`."""

    max_turns: int = Field(3, ge=1, description="model turns per episode")
    max_context_tokens: int = Field(768, ge=64, description="an episode whose tokens reach this is truncated")
    max_new_tokens: int = Field(96, ge=1, description="per model turn")
    command_timeout_s: float = Field(10.0, gt=0, description="one bash tool call")
    observation_chars: int = Field(400, ge=32, description="a tool result beyond this is cut, keeping head and tail")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="the first message of every episode and "
                               "SFT demonstration")
    tool_schema_in_prompt: bool = Field(False, description="render the environment's tool schemas (Harbor: bash) into the prompt "
                                        "(tiny models do better without it; chat models trained on tools, with it)")
    tool_format: Literal["auto", "hermes", "qwen3_coder", "llama3_json", "harmony"] = Field(
        "auto", description="how the model writes tool calls and ends its turns (docs/models.md#tool-call-formats); "
                            "auto: read from the tokenizer's chat template, an error when it cannot tell")


class SFTConfig(_Node):
    """A short warm-start: enough to learn the tool-call format, leaving the policy noisy for RL to sharpen."""

    families: tuple[str, ...] | None = Field(
        DEFAULT_SFT_FAMILIES, description="the families whose oracle demonstrations SFT shows the model (each "
        "one of train.families); the others are reward-only: RL learns them from the verifier alone. "
        "null: all of train.families, which is also what setting train.families alone means")
    instances_per_family: int = Field(128, ge=1, description="train instances of each family demonstrated")
    epochs: int = Field(4, ge=0, description="passes over the demonstrations; 0: no SFT (the anchor may still "
                        "use them)")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate")
    batch_size: int = Field(8, ge=1, description="demonstrations per optimizer step")
    concurrency: int = Field(16, ge=1, description="oracle solutions replayed at once, each in its own sandbox")


class RLConfig(_Node):
    families: tuple[str, ...] | None = Field(
        DEFAULT_RL_FAMILIES, description="the families RL draws its train tasks from (each one of "
        "train.families); null: all of them, which is also what setting train.families or train.sft.families "
        "alone means. Held-out evals always cover every family")
    steps: int = Field(20, ge=0, description="RL steps (each: one batch, one or more optimizer steps)")
    tasks_per_step: int = Field(16, ge=1, description="GRPO groups per step, one task each")
    group_size: int = Field(8, ge=2, description="episodes per group (the advantage baseline is their mean)")
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature (the trainer uses it too)")
    lr: float = Field(2e-4, gt=0, description="AdamW peak learning rate")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon: coordinates whose gradient is below it move less")
    warmup_steps: int = Field(5, ge=0, description="optimizer steps of linear lr warm-up")
    lr_decay: Literal["constant", "cosine"] = Field(
        "cosine", description="after warm-up: keep lr, or follow a cosine to min_lr_ratio * lr at the last step")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay ends at this fraction of lr")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0: no clipping (the norm is logged)")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass over a step's episodes")
    epochs: int = Field(1, ge=1, description="passes over a step's episodes (PPO-style reuse of a batch)")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 (1 - clip_low)")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (1 + clip_high; DAPO's clip-higher)")
    tis_cap: float = Field(2.0, gt=0, description="tis: truncation of the train/rollout importance weight")
    kl_coef: float = Field(0.05, ge=0, description="k3 KL penalty to the SFT model (a frozen copy is kept); "
                           "keeps the tool-call format the SFT taught while RL learns (docs/training.md#stability)")
    sft_coef: float = Field(1.0, ge=0, description="demonstration anchor (PPO-ptx): each optimizer step adds this "
                            "times the NLL of sft_batch of SFT's demonstrations, so a demonstrated skill that RL "
                            "erodes is pulled back even when its groups all fail (docs/training.md#stability)")
    sft_batch: int = Field(16, ge=1, description="demonstrations per optimizer step for the anchor (sft_coef)")
    negative_weight: float = Field(0.1, ge=0, le=1, description="scale of negative advantages; < 1 sharpens "
                                   "(1: plain GRPO; see docs/training.md#results)")
    normalize_std: bool = Field(False, description="divide advantages by the group std (measured worse here)")
    adv_eps: float = Field(1e-6, gt=0, description="normalize_std: advantages are divided by (group std + this)")
    filter_zero_variance: bool = Field(True, description="drop groups whose rewards are all equal (no signal)")
    micro_batch_size: int = Field(16, ge=1, description="episodes per forward/backward pass")
    bf16_autocast: bool = Field(False, description="bf16 compute in the trainer; weights stay fp32")
    concurrency: int = Field(16, ge=1, description="episodes (sandboxes) at once; the engine batches their turns")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints (the last step always saves)")
    time_budget_s: float | None = Field(
        None, gt=0, description="stop RL after the step whose end crosses this many seconds of RL step time "
                                "(resumed runs included); null: run all `steps`")
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: rollouts keep running while the trainer trains (furlong.rollout.scheduler)")
    max_inflight_groups: int | None = Field(
        None, ge=1, description="async: GRPO groups running or waiting at once; null: 2 * tasks_per_step "
                                "(sync always runs one step's groups)")
    max_staleness: int = Field(2, ge=0, description="async: most weight versions between a trained episode's "
                                                    "oldest sampled token and the version being trained")
    stale_policy: Literal["drop", "requeue"] = Field(
        "requeue", description="a group past max_staleness: drop it (the next group of the stream runs instead) "
                               "or re-run its task")
    off_policy: Literal["tis", "masked_is", "decoupled_ppo"] = Field(
        "tis", description="correction for rollout/train policy mismatch (see furlong.train.grpo)")
    mask_level: Literal["token", "sequence"] = Field("token", description="masked_is: drop tokens or whole episodes")
    is_low: float = Field(0.5, gt=0, description="masked_is: keep tokens whose train/rollout ratio >= this")
    is_high: float = Field(2.0, gt=0, description="masked_is: ... and <= this")

    @model_validator(mode="after")
    def _is_range(self) -> RLConfig:
        if self.is_low > self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must be <= is_high ({self.is_high})")
        return self

    def inflight_groups(self) -> int:
        """How many groups may run at once: one step's worth in sync mode (zero overlap with training)."""
        if self.mode == "sync":
            return self.tasks_per_step
        return self.max_inflight_groups or 2 * self.tasks_per_step


class LoraConfig(_Node):
    """Train only low-rank adapters (PEFT); the base stays frozen and only adapters go to the engine."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    rank: int = Field(8, ge=1, description="adapter rank")
    alpha: int = Field(16, ge=1, description="adapter scale numerator (scale = alpha / rank)")
    targets: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj"), description="module names "
                                     "that get adapters")


class FSDP2Config(_Node):
    """`train.trainer: fsdp2`: the policy sharded over rank processes (furlong.train.fsdp2; docs/training.md,
    "FSDP2")."""

    world_size: int = Field(2, ge=1, description="rank processes (train.device=cuda: one GPU each)")
    timeout_s: float = Field(600.0, gt=0, description="a rank's start, and a collective whose peer is gone, "
                             "fail after this long")


class SyncConfig(_Node):
    """How each RL step's weights reach the rollout engine (furlong.sync; docs/weight-sync.md)."""

    transport: Literal["direct", "inprocess", "directory", "http", "broadcast"] = Field(
        "direct", description="direct: copy into the in-process engine; broadcast (engine=server): send every "
                              "tensor over a torch.distributed group with the engine servers; otherwise publish "
                              "full/delta updates that a relay verifies and loads")
    engine: Literal["inprocess", "server"] = Field(
        "inprocess", description="server: the RL rollout engine runs in its own process with its relay beside it")
    servers: int = Field(1, ge=1, description="engine=server: this many engine processes behind one router "
                                              "(furlong.engine.router: least-loaded, sticky, failover)")
    engine_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="published weights' dtype; bfloat16 halves the bytes, but rollouts then "
                               "differ from the fp32 trainer by ~5e-2 in logprob (TIS corrects for it)")
    full_every: int = Field(20, ge=1, description="a full snapshot every this many publishes bounds the chain")
    dir: Path | None = Field(None, description="published updates (directory/http); null: RUN_DIR/weights")
    keep: int = Field(2, ge=0, description="updates kept before the newest full snapshot when pruning")
    momentum: bool = Field(True, description="predict dense deltas from the previous one: smaller payloads, for up "
                                             "to 2 bytes of state per word of dense tensors at each end")
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="transport=broadcast: the torch.distributed backend (nccl needs a GPU at every rank)")
    master_address: str = Field("127.0.0.1", description="transport=broadcast: the trainer's address that the "
                                                           "engines join its group at (loopback or a private network)")
    bucket_mb: float = Field(256, gt=0, description="transport=broadcast: tensors go in flat buckets of at most "
                                                    "this many MiB, one broadcast each")

    @model_validator(mode="after")
    def _server_needs_files(self) -> SyncConfig:
        if self.engine == "server" and self.transport not in ("directory", "http", "broadcast"):
            raise ValueError(f"engine=server takes updates from files, HTTP or a broadcast: set transport to "
                             f"directory, http or broadcast (got {self.transport!r})")
        if self.transport == "broadcast" and self.engine != "server":
            raise ValueError("transport=broadcast sends weights to engine server processes: set engine to server")
        if self.servers > 1 and self.engine != "server":
            raise ValueError(f"servers={self.servers} runs engine processes: set engine to server "
                             f"(got {self.engine!r})")
        return self


class SGLangConfig(_Node):
    """`train.engine: sglang`: attach to a running SGLang server (url) or start one (furlong.engine.sglang_launch)."""

    url: str | None = Field(None, description="a running server's base URL; null: start one for the run")
    python: str | None = Field(None, description="interpreter that has sglang installed; null: this one")
    launch_module: str = Field("sglang.launch_server", description="run with python -m (tests: tests.sglang_standin)")
    port: int = Field(0, ge=0, description="0: a free port")
    extra_args: tuple[str, ...] = Field((), description="more launch_server flags, e.g. [--mem-fraction-static, 0.5]")
    start_timeout_s: float = Field(600.0, gt=0, description="a started server must answer within this")
    weights_via: Literal["disk", "tensor"] = Field(
        "disk", description="disk: each update is a checkpoint the server loads (/update_weights_from_disk); "
                            "tensor: /update_weights_from_tensor (same host only)")


class HFEngineConfig(_Node):
    """The in-process hf engine (furlong.engine.hf) that runs rollouts and held-out evals."""

    prefix_cache_mb: float = Field(
        256, ge=0, description="KV of finished turns kept for later turns and group members that share their "
                               "prefix (LRU within this many MiB); 0 disables the prefix cache")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the in-process engine's model runs (RL "
                                           "rollouts and held-out evals; with train.device=cuda, weights are "
                                           "copied GPU to GPU)")


class RayConfig(_Node):
    """`train.cluster: ray`: the rollout engines and the RL trainer run as Ray actors (furlong.cluster;
    docs/cluster.md). Resources are Ray's logical CPUs, reserved in placement groups, one bundle per actor."""

    address: str | None = Field(None, description="null: start a local Ray cluster for the run (stopped at its "
                                                   "end); an address (`auto`, HOST:PORT) joins a running one")
    num_cpus: float | None = Field(None, gt=0, description="a local cluster's logical CPUs; null: what the "
                                                           "bundles reserve")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: one placement group packs the trainer and the engines on one node; "
                                 "disaggregated: a trainer group and an engine group spread over the nodes")
    engines: int = Field(1, ge=1, description="engine actors (each an engine server with its relay) behind "
                                              "furlong.engine.router when more than one")
    engine_cpus: float = Field(1.0, gt=0, description="logical CPUs each engine actor's bundle reserves")
    trainer_cpus: float = Field(1.0, gt=0, description="logical CPUs the trainer actor's bundle reserves")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs each trainer actor's bundle reserves (train.device=cuda "
                                                       "needs > 0); a fraction shares a GPU (colocated: 0.5 each)")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs each engine actor's bundle reserves; > 0: the engine "
                                                      "runs on CUDA")
    max_restarts: int = Field(3, ge=0, description="times Ray restarts a dead engine actor (same address; "
                                                   "the router readmits it at the live weight version)")
    start_timeout_s: float = Field(180.0, gt=0, description="how long placement groups and actors may take to "
                                                            "become ready")


class TrainEvalConfig(_Node):
    heldout_per_family: int = Field(64, ge=1, description="held-out instances of each family, one episode each "
                                                           "(the bundled families have 128)")
    temperature: float = Field(1.0, ge=0, description="pass@1 is measured by sampling at this temperature")
    seed: int = Field(1234, description="sampling seeds of held-out episodes derive from this")
    concurrency: int = Field(16, ge=1, description="held-out episodes (sandboxes) at once")


class RewardConfig(_Node):
    """One reward function of `train.env.rewards` (furlong.envs.rewards): a Python callable or a command,
    weighed into the episode's reward."""

    python: str | None = Field(None, description='"module:function" on the Python path, called with the finished '
                               "episode (furlong.envs.rewards.EpisodeView), sync or async; returns a number")
    command: str | None = Field(None, description="run in the episode's sandbox as the verifier, after the tests "
                                "(Harbor tasks only); the last line of its output is the value")
    weight: float = Field(1.0, description="its weight in the episode's reward")
    timeout_s: float = Field(60.0, gt=0, description="past this it has failed (the failure rule: "
                             "docs/environments.md)")

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if (self.python is None) == (self.command is None):
            raise ValueError("give exactly one of python and command")
        return self


class PromptsConfig(_Node):
    """A prompt dataset for single-turn RL with a Python reward function, instead of Harbor tasks: each row a
    prompt, the model answers once, `reward(completion, row)` scores it; no sandbox, no tools
    (furlong.envs.prompts; docs/prompts.md). On when `path`, or `train_path` and `heldout_path`, are set."""

    path: Path | None = Field(None, description="one dataset holding both splits: a JSONL or Parquet file, or a "
                              "Hugging Face datasets directory (save_to_disk, or a folder of data files); its "
                              "held-out rows by split_field, heldout_fraction, or a DatasetDict's own splits")
    train_path: Path | None = Field(None, description="instead of path: the train rows (one table)")
    heldout_path: Path | None = Field(None, description="with train_path: the held-out rows (one table)")
    format: Literal["auto", "jsonl", "parquet", "hf"] = Field(
        "auto", description="auto: by the suffix (.jsonl, .ndjson, .json: JSONL; .parquet), a directory is hf")
    prompt_field: str = Field("prompt", description="the field holding the prompt (the user message, a string)")
    system_field: str | None = Field("system", description="a row's own system message where it has this field "
                                     "(a string), in place of train.agent.system_prompt; null: never")
    answer_field: str | None = Field(None, description="a reference completion (a string or number): SFT "
                                     "demonstrates it where the reward function gives it 1, `furlong eval --agent "
                                     "oracle` answers it. null: no SFT (train.sft.epochs, train.rl.sft_coef 0)")
    split_field: str | None = Field(None, description="path: the field naming each row's split (its values: "
                                    "splits); rows of other values are left out")
    splits: dict[str, str] = Field({"train": "train", "heldout": "test"}, description="furlong's split -> "
                                   "the split_field value, or the DatasetDict split, that holds its rows")
    heldout_fraction: float | None = Field(None, gt=0, lt=1, description="path, one table, no split_field: hold "
                                           "out this fraction of the rows, drawn with a fixed seed")
    reward: str | None = Field(None, description='the reward function: "module:function" on the Python path, or '
                               '"FILE.py" / "FILE.py:function" (default name `reward`); reward(completion: str, '
                               "row: dict) -> float, sync or async")
    reward_timeout_s: float = Field(30.0, gt=0, description="one reward call; past it the episode is infra_error")
    name: str | None = Field(None, description="the family of its instances (reports, summary.json); null: the "
                             "dataset's file or directory name without its suffix")

    @property
    def active(self) -> bool:
        return self.path is not None or self.train_path is not None or self.heldout_path is not None

    @model_validator(mode="after")
    def _one_source(self) -> PromptsConfig:
        if not self.active:
            return self
        if self.path is not None and (self.train_path or self.heldout_path):
            raise ValueError("give path, or train_path and heldout_path, not both")
        if self.path is None and (self.train_path is None or self.heldout_path is None):
            raise ValueError("train_path and heldout_path: give both (or path, for one dataset with both splits)")
        if self.path is None and (self.split_field or self.heldout_fraction):
            raise ValueError("split_field and heldout_fraction split path's rows; train_path and heldout_path "
                             "are already split")
        if self.split_field and self.heldout_fraction:
            raise ValueError("split_field or heldout_fraction: one way to pick the held-out rows")
        if set(self.splits) != {"train", "heldout"}:
            raise ValueError(f"splits: expected the keys train and heldout, got {sorted(self.splits)}")
        if self.reward is None:
            raise ValueError('reward: the reward function is needed ("module:function" or "FILE.py")')
        return self

    def family(self) -> str:
        source = self.path or self.train_path
        return self.name or (source.stem if source is not None else "prompts")


class EnvConfig(_Node):
    """Your own environment, tools and reward functions, for training, its held-out evals and `furlong eval`
    (docs/environments.md)."""

    python: str | None = Field(None, description='"module:factory" on the Python path: a Python environment '
                               "(reset/step) instead of Harbor tasks; its family is the factory's name. null: the "
                               "Harbor tasks of train.tasks and train.families")
    openenv: bool = Field(False, description="episodes on the OpenEnv server of the `openenv` section instead of "
                          "Harbor tasks (docs/openenv.md; no oracle demonstrations: train.sft.epochs and "
                          "train.rl.sft_coef must be 0)")
    prompts: PromptsConfig = Field(PromptsConfig(), description="a prompt dataset and its reward function "
                                   "instead of Harbor tasks (single-turn, no sandbox)")
    train_instances: int = Field(128, ge=1, description="python: train instances (seeds 0..N-1 of split train); "
                                 "held-out ones: train.eval.heldout_per_family")
    agent_timeout_s: float = Field(600.0, gt=0, description="python and prompts: an episode's time limit for the "
                                   "agent (a Harbor task's is in its task.toml)")
    tools: tuple[str, ...] = Field((), description='"module:attribute" of each furlong.envs.toolset.Tool (or a list '
                                   "of them): tools beside bash (Harbor) or the environment's own (python)")
    rewards: dict[str, RewardConfig] = Field({}, description="reward functions by name (their keys in the episode's "
                                             "rewards), each as in train.env.rewards.<name>")
    tests_weight: float = Field(1.0, description="weight of the environment's own reward beside train.env.rewards "
                                "(Harbor: the tests'; python: its steps' rewards summed)")

    @model_validator(mode="after")
    def _names(self) -> EnvConfig:
        if reserved := sorted(set(self.rewards) & {"reward", "tests", "steps"}):
            raise ValueError(f"rewards: the names {reserved} are reserved for the episode's own rewards")
        chosen = [k for k, on in (("python", self.python is not None), ("openenv", self.openenv),
                                  ("prompts", self.prompts.active)) if on]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)}: one environment at a time")
        if self.prompts.active and (self.tools or self.rewards):
            raise ValueError("tools and rewards: a prompt dataset has no tools, and its one reward is "
                             "prompts.reward (weigh your terms inside it)")
        if self.python is not None and ":" not in self.python:
            raise ValueError(f'python: expected "module:factory", got {self.python!r}')
        return self

    def family(self) -> str | None:
        """The one family of a Python environment's instances (its factory's name) or a prompt dataset's."""
        if self.prompts.active:
            return self.prompts.family()
        return None if self.python is None else self.python.rpartition(":")[2]

    def demonstrable(self) -> bool:
        """Whether SFT has demonstrations in this environment: a prompt dataset's answers; a Python
        environment has none; Harbor tasks' oracle solutions (an OpenEnv server's: TrainConfig's rule)."""
        if self.prompts.active:
            return self.prompts.answer_field is not None
        return self.python is None


class WandbConfig(_Node):
    """Weights & Biases, beside metrics.jsonl and TensorBoard: the same rows, each key as `<phase>/<key>`."""

    enabled: bool = Field(False, description="log to W&B too (the wandb package: pip install wandb); off, wandb "
                          "is never imported")
    project: str = Field("furlong", description="the W&B project")
    mode: Literal["offline", "online"] = Field("offline", description="offline: files only (upload later with "
                                               "`wandb sync`); online: to the W&B server (needs a login)")
    dir: Path | None = Field(None, description="where wandb writes its files; null: the run directory")


class LogConfig(_Node):
    """Where a run's metrics go beside RUN_DIR/metrics.jsonl and TensorBoard's RUN_DIR/tb."""

    wandb: WandbConfig = Field(WandbConfig(), description="Weights & Biases")


class TrainConfig(_Node):
    tasks: Path = Field(BUNDLED_TASKS, description="the directory that holds train.families")
    families: tuple[str, ...] = Field(DEFAULT_FAMILIES, description="task families (directories under "
                                      "train.tasks) that SFT, RL and the held-out evals use")
    run_dir: Path | None = Field(None, description="null: runs/<date-time>")
    seed: int = Field(0, description="the run's seed: group order, minibatch shuffles, SFT order, LoRA init")
    engine: Literal["hf", "vllm", "sglang"] = Field(
        "hf", description="hf (in-process); vllm: rollouts and evals (the vllm extra; furlong.engine.vllm); "
                          "sglang: RL rollouts on an SGLang server, evals stay on hf (train.sglang)")
    sglang: SGLangConfig = Field(SGLangConfig(), description="train.engine=sglang: the server")
    cluster: Literal["local", "ray"] = Field(
        "local", description="local: every role in this process (or engine processes, train.sync.engine); "
                             "ray: the RL trainer and engines as Ray actors (train.ray; their count is "
                             "train.ray.engines, train.sync.engine and servers are not used)")
    ray: RayConfig = Field(RayConfig(), description="train.cluster=ray: the cluster, its placement and resources")
    torch_threads: int = Field(1, ge=1, description="1 is fastest for the tiny model on a shared 2-core box")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the trainer keeps and trains the policy "
                                           "(and its KL reference)")
    trainer: Literal["local", "fsdp2"] = Field("local", description="local: the policy in this process; fsdp2: "
                                               "sharded over train.fsdp2.world_size rank processes")
    fsdp2: FSDP2Config = Field(FSDP2Config(), description="train.trainer=fsdp2: its ranks")
    model: ModelConfig = Field(ModelConfig(), description="the starting checkpoint")
    agent: AgentConfig = Field(AgentConfig(), description="the agent loop's limits and prompt")
    sft: SFTConfig = Field(SFTConfig(), description="the SFT warm-start")
    rl: RLConfig = Field(RLConfig(), description="GRPO")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters")
    sync: SyncConfig = Field(SyncConfig(), description="weight sync to the rollout engine")
    hf: HFEngineConfig = Field(HFEngineConfig(), description="the in-process hf engine")
    eval: TrainEvalConfig = Field(TrainEvalConfig(), description="the held-out evals before and after RL")
    env: EnvConfig = Field(EnvConfig(), description="your own environment, tools and reward functions")
    log: LogConfig = Field(LogConfig(), description="metrics beside metrics.jsonl and TensorBoard")

    @model_validator(mode="after")
    def _vllm_engine_supports(self) -> TrainConfig:
        if self.engine == "vllm" and self.sync.engine == "server":
            raise ValueError("train.engine=vllm runs vLLM's own engine process: set train.sync.engine=inprocess "
                             "(sync.engine=server is the hf engine server)")
        return self

    @model_validator(mode="after")
    def _ray_cluster_supports(self) -> TrainConfig:
        if self.cluster == "ray" and self.engine != "hf":
            raise ValueError(f"train.cluster=ray runs the hf engine server in Ray actors: set train.engine=hf "
                             f"(got {self.engine!r})")
        if self.cluster == "ray" and (self.device == "cuda") != (self.ray.trainer_gpus > 0):
            raise ValueError(f"train.cluster=ray: train.device={self.device} needs train.ray.trainer_gpus "
                             f"{'> 0 (the trainer actor must hold a GPU)' if self.device == 'cuda' else '= 0'} "
                             f"(got {self.ray.trainer_gpus:g})")
        if self.cluster == "ray" and self.sync.transport == "broadcast":
            raise ValueError("train.cluster=ray: engine actors take updates from files or HTTP (train.sync.transport"
                             "=directory or http); the broadcast transport is for train.sync.engine=server")
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
        environment, a dataset without answer_field) there is no SFT (train.sft.families empty,
        train.sft.epochs 0) and no demonstration anchor (train.rl.sft_coef 0)."""
        family, key = self.env.family(), "train.env.python" if self.env.python else "train.env.prompts"
        if own and self.families != (family,):
            raise ValueError(f"train.families: with {key} the run's one family is {family!r}; drop train.families")
        object.__setattr__(self, "families", (family,))
        if self.env.demonstrable():
            return
        what = ("a Python environment has no oracle demonstrations" if self.env.python else
                "the prompt dataset has no answers to demonstrate (train.env.prompts.answer_field)")
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
            raise ValueError("train.env.openenv: an OpenEnv server has no oracle solutions to demonstrate; set "
                             "train.sft.epochs=0 and train.rl.sft_coef=0 (start from a trained train.model.path)")
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


class Config(_Node):
    sandbox: SandboxConfig = Field(SandboxConfig(), description="sandboxes, for every command")
    images: ImagesConfig = Field(ImagesConfig(), description="base images from registries")
    eval: EvalConfig = Field(EvalConfig(), description="`furlong eval`")
    openenv: OpenEnvConfig = Field(OpenEnvConfig(), description="the OpenEnv server of train.env.openenv "
                                   "and eval.env=openenv")
    train: TrainConfig = Field(TrainConfig(), description="`furlong train` and `furlong sft`")


class ConfigError(ValueError):
    pass


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    node[leaf] = value


def _value(key: str, raw: str) -> Any:
    """An override's value, read as YAML (4, true, [a, b], null); empty is null."""
    if not raw.strip():
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"override {key}={raw}: {problem} (values are YAML: 4, true, [a, b], null)") from None


def load_config(recipe: Path | None = None, overrides: list[str] = ()) -> Config:
    tree: dict = {}
    if recipe is not None:
        try:
            tree = yaml.safe_load(Path(recipe).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"recipe {recipe}: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe {recipe}: expected a mapping at the top level")
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. eval.concurrency=4")
        _set(tree, key.strip(), _value(key.strip(), raw))
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()]
        where = f" in {recipe}" if recipe else ""
        sep = " " if len(problems) == 1 else "\n  "  # one problem, one line
        raise ConfigError(f"invalid config{where}:{sep}" + "\n  ".join(problems)) from None
