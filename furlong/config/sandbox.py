"""Sandboxes, images, the OpenEnv server and `furlong eval`: the nodes every command shares."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from furlong.config.base import BUNDLED_TASKS, _Node

PhaseMode = Literal["no-network", "public", "packages"]


class NetworkConfig(_Node):
    """The network of tasks whose task.toml names no network mode (Harbor would give them `public`), per
    phase, and what `packages` reaches (furlong.sandbox.network; docs/sandboxes.md, "Networked sandboxes")."""

    agent: PhaseMode = Field(
        "no-network",
        description="the agent phase of a task that names no network mode: "
        "no-network (the default: RL agents stay offline), public (Harbor's default), or "
        "packages (package indexes only)",
    )
    verifier: PhaseMode = Field(
        "no-network",
        description="the verifier phase (the task's tests) of such a task: "
        "packages lets tests that install what they need at test time pass while the "
        "agent stays offline; public is Harbor's default",
    )
    package_hosts: list[str] = Field(
        [],
        description="allowlist entries `packages` reaches beside the package "
        "indexes (PyPI, the host's pip and uv indexes, Debian and Ubuntu mirrors and "
        "the host's apt sources, uv's installer) and sandbox.debian_mirror",
    )


class SandboxConfig(_Node):
    backend: Literal["bwrap", "remote", "gvisor"] = Field(
        "bwrap",
        description="the sandbox backend (bwrap: bubblewrap namespaces here; remote: on sandbox.hosts, "
        "`furlong sandbox serve` hosts, which also build the images; gvisor: gVisor's runsc here, no network, "
        "no verifier identity: docs/sandboxes.md#the-gvisor-backend)",
    )
    hosts: list[str] = Field(
        [],
        description="backend=remote: the hosts' URLs (http://H:P); sandboxes go to the least loaded one that answers",
    )
    host_token_file: Path | None = Field(
        None,
        description="backend=remote: the file holding the hosts' bearer "
        "token; null: the one `furlong sandbox serve` generates on loopback "
        "($FURLONG_CACHE/host-token)",
    )
    host_uid: int = Field(61000, gt=0, description="unprivileged uid sandboxes run as when furlong runs as root")
    output_cap_bytes: int = Field(
        1 << 20, gt=0, description="stdout and stderr kept per command; the rest is cut, and the cut is marked"
    )
    seccomp: bool = Field(
        True,
        description="the syscall filter (furlong.sandbox.runtime.seccomp): false turns it off for "
        "every sandbox; true filters each sandbox whose task keeps [environment] seccomp = true "
        "(the default)",
    )
    debian_mirror: str = Field("http://deb.debian.org/debian", description="apt mirror for building the base image")
    snapshot_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="how long a sandbox snapshot (snapshot, fork) can be restored; expired ones are removed",
    )
    snapshot_max_mb: int = Field(
        4096, gt=0, description="disk the snapshot store may hold; a snapshot past it is refused with an error"
    )
    network: NetworkConfig = Field(NetworkConfig(), description="tasks that name no network mode, and `packages`")


class ImagesConfig(_Node):
    """Base images pulled from registries (furlong.sandbox.images.registry; docs/images.md, "Base images from
    registries"), the Debian stand-ins for official images (furlong.sandbox.images.standins; docs/images.md,
    "Stand-ins"), and what builds and networked sandboxes borrow from the host (furlong.sandbox.runtime.egress)."""

    prefer_registry: bool = Field(
        False,
        description="pull the names furlong has stand-ins for (python:*, "
        "debian:bookworm...) from their registry too; env FURLONG_PREFER_REGISTRY=1",
    )
    standins: Literal["nearest", "exact"] = Field(
        "nearest",
        description="a tag whose version Debian does not ship (python:3.12, node:22): nearest: the "
        "stand-in with the nearest version, and its note says so; exact: a one-line error "
        "naming the versions Debian has (Go always needs its exact release)",
    )
    ubuntu_standins: Literal["off", "nearest", "bookworm", "trixie"] = Field(
        "off",
        description="ubuntu:24.04|22.04|20.04 (and noble, jammy, focal) where no registry, cache or import "
        "serves them: off: a one-line error; nearest: furlong's Debian stand-in (24.04: trixie; "
        "22.04, 20.04: bookworm), its note saying what differs (apt's sources stay Debian's); "
        "bookworm or trixie: that Debian release for every Ubuntu tag (docs/images.md)",
    )
    registry_auth_file: Path | None = Field(
        None,
        description="a containers-auth.json for private registries "
        "(skopeo --authfile); null: $REGISTRY_AUTH_FILE, else skopeo's defaults",
    )
    pull_timeout_s: float = Field(1800.0, gt=0, description="one image pull")
    trust_host_ca: bool = Field(
        False,
        description="build steps and networked sandboxes trust the host's CA "
        "certificates (host_ca_bundle, bound read-only; SSL_CERT_FILE, PIP_CERT... name it): "
        "for TLS-intercepting proxies and internal mirrors. They then trust whatever the "
        "host trusts, an interception CA included (docs/images.md)",
    )
    host_ca_bundle: Path | None = Field(
        None,
        description="trust_host_ca: the PEM bundle; null: the one the host's "
        "pip and Python verify with (pip's cert, else SSL_CERT_FILE, else OpenSSL's)",
    )
    offline_uv: bool = Field(
        False,
        description="a RUN step that fetches uv's installer (curl or wget of "
        "astral.sh/uv/[VERSION/]install.sh or a release's uv-installer.sh, written out) gets "
        "uv and uvx copied from the verifier toolchain instead, where the installer puts them: "
        "for builds that cannot reach astral.sh. The toolchain's uv version, not the URL's; "
        "the image's note says so (docs/images.md)",
    )
    package_mirrors: Literal["none", "host"] = Field(
        "none",
        description="host: build steps and networked sandboxes get the host pip's http(s) index settings "
        "(PIP_INDEX_URL, pip.conf), its proxy variables and apt's proxy settings",
    )


class OpenEnvConfig(_Node):
    """An OpenEnv environment server that episodes run on when train.env or eval.env is openenv
    (furlong.envs.openenv; docs/openenv.md). One WebSocket session per episode."""

    url: str | None = Field(None, description="the server's base URL (http://H:P or ws://H:P)")
    token_file: Path | None = Field(
        None,
        description="a file holding the bearer token the server wants "
        "(`furlong openenv serve`'s --token-file); null: send none",
    )
    instances: dict[str, int] = Field(
        {"train": 64, "heldout": 16},
        description="most instances per split: the "
        "server's own tasks of that split where it lists them (its task API), else "
        "resets with seeds 0.. (train) and after the train seeds (heldout)",
    )
    splits: dict[str, str] = Field(
        {"train": "train", "heldout": "heldout"},
        description="furlong's split -> the server's split name in its task API",
    )
    instruction: str = Field(
        "",
        description="the user message before the environment's first observation "
        "(a furlong server's observation carries the task's instruction itself)",
    )
    tool_name: str = Field(
        "step",
        description="the one tool the model calls when the server lists no tools: "
        "its arguments are an action of the server's /schema",
    )
    agent_timeout_s: float = Field(
        600.0, gt=0, description="an episode's agent phase, where the server's task API gives none"
    )
    connect_timeout_s: float = Field(30.0, gt=0, description="opening a session")
    message_timeout_s: float = Field(
        900.0,
        gt=0,
        description="one reset or step, the tests a furlong server "
        "runs at the end included; past it the session counts as lost",
    )


class EvalConfig(_Node):
    env: Literal["harbor", "openenv"] = Field(
        "harbor",
        description="harbor: tasks (eval.tasks) in sandboxes here; openenv: the server of the `openenv` section",
    )
    tasks: Path = Field(BUNDLED_TASKS, description="a task, a task family, or a directory of them")
    agent: Literal["oracle", "noop", "model"] = Field(
        "oracle",
        description="oracle: the task's solution; noop: does nothing; model: eval.model in the training "
        "agent loop (limits: train.agent.*)",
    )
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
    verifier_toolchain: bool = Field(
        False,
        description="give every task's verifier uv, uvx and pytest, offline "
        "where the verifier phase is (a layer on the image, on the "
        "verifier's PATH only: the agent's environment stays the "
        "image's); a task opts in alone with [furlong] "
        "verifier_toolchain",
    )
