"""task.toml's schema: Harbor's tables and keys as furlong reads them (furlong.tasks.loader resolves them).

A key that neither Harbor nor furlong defines is an error naming it: a typo such as `timeout_secs` must not
leave the task on a default. Harbor's keys that furlong does not act on are declared `Any` so that
Harbor's tasks keep loading.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from furlong.sandbox.images.registry import Reference

MAIN_SERVICE = "main"  # Harbor's name for the agent's container; any other is a docker-compose sidecar


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


NetworkMode = Literal["no-network", "public", "allowlist"]


class Agent(Section):
    timeout_sec: float = Field(600.0, gt=0)
    user: str | int | None = None  # who the agent runs as (None: the image's USER), as in Harbor
    network_mode: NetworkMode | None = None  # Harbor's phase override: see furlong.tasks.network
    allowed_hosts: list[str] | None = None


class StepAgent(Agent):
    timeout_sec: float | None = Field(None, gt=0)  # type: ignore[assignment]  # None: the task's [agent] timeout_sec


class Environment(Section):
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    network_mode: NetworkMode | None = None  # Harbor >= 0.2's; wins over the older allow_internet
    allowed_hosts: list[str] | None = None
    allow_internet: bool | None = None
    network: bool | None = None  # furlong's older spelling of allow_internet
    os: Literal["linux", "windows"] = "linux"
    seccomp: bool = True  # furlong's own keys: the syscall filter, and names taken off its deny list
    seccomp_allow: list[str] = []
    docker_image: str | None = None  # Harbor's prebuilt image, used before environment/Dockerfile
    # Harbor's keys furlong does not act on: there are no GPUs, storage quotas, MCP servers or skills in a
    # sandbox
    build_timeout_sec: Any = None
    storage_mb: Any = None
    gpus: Any = None
    gpu_types: Any = None
    tpu: Any = None
    mcp_servers: Any = None
    env: Any = None
    skills_dir: Any = None
    healthcheck: Any = None
    workdir: Any = None
    memory: str | None = None  # Harbor's deprecated spelling of memory_mb ("4G", "512M")
    storage: Any = None

    @field_validator("docker_image")
    @classmethod
    def _reference(cls, ref: str | None) -> str | None:
        if ref is not None and Reference.parse(ref) is None:
            raise ValueError(
                "expected an image reference (NAME[:TAG][@sha256:HEX], NAME optionally starting with REGISTRY/)"
            )
        return ref

    @field_validator("memory")
    @classmethod
    def _size(cls, size: str | None) -> str | None:
        if size is not None:
            megabytes(size)
        return size

    @model_validator(mode="after")
    def _memory_spelling(self) -> Environment:
        if self.memory is not None and "memory_mb" not in self.model_fields_set:
            self.memory_mb = megabytes(self.memory)
        return self


def megabytes(size: str) -> int:
    units = {"G": 1024, "M": 1, "K": 1 / 1024}
    number, unit = size.strip()[:-1], size.strip()[-1:].upper()
    try:
        mb = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise ValueError("expected a size like '4G' or '512M'") from None
    if mb <= 0:
        raise ValueError("under a megabyte")
    return mb


class Collect(Section):
    """A [[verifier.collect]] hook."""

    command: str
    service: str = MAIN_SERVICE
    timeout_sec: float = Field(60.0, gt=0)
    user: Any = None  # Harbor's; the hook runs as the agent


class Verifier(Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = {}
    # furlong's: the agent may replace what the tests execute (the task is about a tool); see
    # furlong.tasks.integrity. Tampering is still recorded in the episode, but not scored 0.
    trust_agent_tools: bool = False
    user: Any = None  # Harbor's; the tests run as furlong's verifier identity
    environment_mode: Literal["shared", "separate"] | None = None
    environment: Environment | None = None  # the separate verifier's sandbox ([environment]'s keys)
    collect: list[Collect] = []
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None

    @model_validator(mode="after")
    def _mode_agrees(self) -> Verifier:
        if self.environment_mode == "shared" and self.environment is not None:
            raise ValueError(
                "environment_mode = 'shared' contradicts [verifier.environment] (a sandbox for the "
                "tests of their own): drop one"
            )
        return self

    @property
    def mode(self) -> str | None:
        """Harbor's resolution at one level: the explicit mode, else "separate" where an environment is
        given, else None (not said here)."""
        return self.environment_mode or ("separate" if self.environment is not None else None)


class Artifact(Section):
    source: str
    destination: str | None = None  # where Harbor's host copy goes: checked as Harbor does, not used
    exclude: list[str] = []
    service: str | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, source: str) -> str:
        if not source.strip() or ".." in PurePosixPath(source).parts:
            raise ValueError(f"an artifact source is a path without '..' components, got {source!r}")
        return source

    @field_validator("destination")
    @classmethod
    def _destination(cls, dest: str | None) -> str | None:
        if not dest:
            return None
        path = PurePosixPath(dest)
        if "\\" in dest or path.is_absolute() or ".." in path.parts or dest.rstrip("/") == "manifest.json":
            raise ValueError(
                f"an artifact destination is a relative path with forward slashes, without '..', "
                f"and not manifest.json, got {dest!r}"
            )
        return dest


def artifact_entries(entries: Any) -> Any:
    """Harbor's short form: a string entry is its source."""
    if isinstance(entries, list):
        return [{"source": e} if isinstance(e, str) else e for e in entries]
    return entries


_BAD_CHARS = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]')
_DEVICE = re.compile(r"(CON|PRN|AUX|NUL|CONIN\$|CONOUT\$|(?:COM|LPT)[1-9¹²³])", re.IGNORECASE)


class Step(Section):
    name: str
    agent: StepAgent = StepAgent()
    verifier: Verifier = Verifier()
    min_reward: float | dict[str, float] | None = None
    healthcheck: Any = None  # Harbor's; furlong runs no healthchecks (nor [environment] healthcheck)
    artifacts: list[Artifact] = []

    _entries = field_validator("artifacts", mode="before")(artifact_entries)

    @field_validator("name")
    @classmethod
    def _portable(cls, name: str) -> str:
        """Harbor's rule: a directory name under steps/ that every host OS can hold."""
        if (
            not name.strip()
            or name in (".", "..")
            or name.endswith((".", " "))
            or _BAD_CHARS.search(name)
            or _DEVICE.fullmatch(name.partition(".")[0].rstrip(" "))
            or len(name.encode()) > 255
        ):
            raise ValueError(
                f"step name {name!r}: a portable directory name (no path separators, control or "
                "reserved characters, device names or trailing dots and spaces; at most 255 bytes)"
            )
        return name


class Furlong(Section):
    """furlong's own task.toml table, named so that no Harbor field can clash with it."""

    verifier_toolchain: bool = False  # furlong.sandbox.images.toolchain: uv, uvx and pytest for the tests, offline too


class Solution(Section):
    env: dict[str, str] = {}  # the oracle's solve.sh runs with these


class HarborToml(Section):
    agent: Agent = Agent()
    verifier: Verifier = Verifier()
    environment: Environment = Environment()
    solution: Solution = Solution()
    furlong: Furlong = Furlong()
    metadata: dict[str, Any] = {}  # free-form: author, difficulty, tags...
    steps: list[Step] = []
    multi_step_reward_strategy: Literal["mean", "final"] | None = None
    artifacts: list[Artifact] = []
    # Harbor's top-level keys furlong does not read
    version: Any = None
    schema_version: Any = None
    task: Any = None
    source: Any = None

    _entries = field_validator("artifacts", mode="before")(artifact_entries)

    @field_validator("steps")
    @classmethod
    def _unique(cls, steps: list[Step]) -> list[Step]:
        seen: set[str] = set()
        for step in steps:
            key = unicodedata.normalize("NFC", step.name).casefold()  # one directory on a case-folding host
            if key in seen:
                raise ValueError(f"step name {step.name!r} is used twice (names differing only in case count as one)")
            seen.add(key)
        return steps
