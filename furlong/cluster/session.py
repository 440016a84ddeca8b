"""The run's Ray cluster and its placement groups.

A local cluster (`train.ray.address: null`) is started for the run and stopped at its end; its processes
carry a tag in their environment and a watchdog (furlong.cluster.reaper) stops them if the driver dies.
An address joins a running cluster: the run's actors belong to its job, and Ray stops them when the
driver goes. Either way every actor lives in a bundle of one of the run's placement groups:

* colocated: one group, STRICT_PACK: [trainer, engine 0, ..., engine N-1] on one node, so weights and
  requests stay on the host;
* disaggregated: a trainer group and an engine group (SPREAD: engines on different nodes where there are);
* either way, a distillation teacher on an engine of its own (train.distill.teacher.engine hf|vllm) has one
  more engine bundle after the rollout engines' (the same train.ray.engine_cpus/engine_gpus);
* and with `train.ray.sandbox_hosts`, either way, a sandbox host group (SPREAD; furlong.cluster.sandboxes).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray._common.utils import get_default_ray_temp_dir
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from furlong.cluster.reaper import TAG_ENV, Watchdog

# The furlong the driver imported, on every worker's path: a checkout run with PYTHONPATH, not an install.
FURLONG_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class Roles:
    """What the run places: `trainer_ranks` trainer actors (one for the local trainer, world_size for
    fsdp2) and `engines` engine actors, with their logical CPUs and GPUs each (a fraction of a GPU shares
    it: colocated on one GPU, trainer and engine take 0.5 each); `teachers` (0 or 1) teacher engine actors,
    each an engine's bundle."""

    engines: int
    engine_cpus: float
    trainer_cpus: float
    placement: str  # colocated | disaggregated
    trainer_ranks: int = 1
    trainer_gpus: float = 0.0
    engine_gpus: float = 0.0
    sandbox_hosts: int = 0
    sandbox_cpus: float = 1.0
    teachers: int = 0

    @property
    def cpus(self) -> float:
        return (
            self.trainer_ranks * self.trainer_cpus
            + (self.engines + self.teachers) * self.engine_cpus
            + self.sandbox_hosts * self.sandbox_cpus
        )

    @property
    def gpus(self) -> float:
        return self.trainer_ranks * self.trainer_gpus + (self.engines + self.teachers) * self.engine_gpus

    def groups(self) -> dict[str, tuple[list[dict[str, float]], str]]:
        """Placement group name -> (bundles, strategy); trainer bundles first in a shared group. Sandbox hosts,
        whatever the placement, have a group of their own (SPREAD), so they need not share the GPU nodes."""
        trainer = [bundle(self.trainer_cpus, self.trainer_gpus)] * self.trainer_ranks
        engines = [bundle(self.engine_cpus, self.engine_gpus)] * (self.engines + self.teachers)
        hosts = (
            {"sandboxes": ([bundle(self.sandbox_cpus, 0.0)] * self.sandbox_hosts, "SPREAD")}
            if self.sandbox_hosts
            else {}
        )
        if self.placement == "colocated":
            return {"run": (trainer + engines, "STRICT_PACK"), **hosts}
        if self.placement == "disaggregated":
            return {"trainer": (trainer, "STRICT_PACK"), "engines": (engines, "SPREAD"), **hosts}
        raise ValueError(f"train.ray.placement: expected colocated or disaggregated, got {self.placement!r}")


def _start_local(num_cpus: int, namespace: str, env: dict[str, str]) -> None:
    """A new local cluster ("local": even where another run's, or `ray start`'s, is up); if it does not
    start, the error carries the tails of its session's process logs (Ray's own says only "timed out")."""
    since = time.time()
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            namespace=namespace,
            runtime_env={"env_vars": env},
        )
    except Exception as exc:
        raise RuntimeError(
            f"train.cluster=ray: the local Ray cluster did not start ({exc}); {startup_logs(since)}"
        ) from exc


def startup_logs(since: float, root: Path | None = None, lines: int = 5) -> str:
    """Where the newest Ray session started after `since` keeps its logs, and the last `lines` lines of
    the head's processes' logs (gcs_server, raylet, agents), for an error message."""
    root = root or Path(get_default_ray_temp_dir())  # RAY_TMPDIR, else the system's, + /ray
    sessions = [d for d in root.glob("session_2*") if d.is_dir() and d.stat().st_mtime >= since - 1]
    if not sessions:
        return f"no Ray session directory under {root} was made after the start"
    logs = max(sessions, key=lambda d: d.stat().st_mtime) / "logs"
    found = sorted(p.name for p in logs.glob("*")) if logs.is_dir() else []
    parts = [f"its logs: {logs} ({', '.join(found) or 'none written'})"]
    for name in STARTUP_LOGS:
        path = logs / name
        if path.is_file() and (tail := path.read_text(errors="replace").strip().splitlines()[-lines:]):
            parts.append(f"{name}: " + " | ".join(tail))
    return "; ".join(parts)


STARTUP_LOGS = (
    "gcs_server.err",
    "gcs_server.out",
    "raylet.err",
    "raylet.out",
    "runtime_env_agent.err",
    "dashboard_agent.err",
)


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


def place(roles: Roles, prefix: str, timeout_s: float) -> dict[str, PlacementGroup]:
    """The roles' placement groups on the connected cluster, each ready (else TimeoutError, all removed)."""
    have = ray.cluster_resources().get("GPU", 0.0)
    if roles.gpus > have:  # a placement group would wait out timeout_s for GPUs that never come
        raise ValueError(
            f"train.ray: the roles reserve {roles.gpus:g} GPUs (trainer_gpus x ranks + engine_gpus x "
            f"engines, the teacher's engine one of them) but the cluster has {have:g}"
        )
    groups = {
        name: placement_group(bundles, strategy=strategy, name=f"{prefix}-{name}")
        for name, (bundles, strategy) in roles.groups().items()
    }
    for name, group in groups.items():
        if not group.wait(timeout_s):
            for g in groups.values():
                remove_placement_group(g)
            raise TimeoutError(
                f"placement group {name!r} ({roles.groups()[name][0]}) not ready within "
                f"{timeout_s:g} s: the cluster has {ray.cluster_resources()}"
            )
    return groups


class RaySession:
    """Ray started or joined, the placement groups ready; `slot(role, i)` schedules an actor in its bundle."""

    def __init__(
        self, roles: Roles, *, address: str | None = None, num_cpus: float | None = None, timeout_s: float = 180.0
    ) -> None:
        self.roles, self.timeout_s, self.local = roles, timeout_s, address is None
        self.tag = f"furlong-{os.getpid()}-{secrets.token_hex(4)}"
        self._watchdog = Watchdog(self.tag) if self.local else None
        env = {"PYTHONPATH": os.pathsep.join(p for p in (FURLONG_ROOT, os.environ.get("PYTHONPATH")) if p)}
        try:
            if self.local:
                os.environ[TAG_ENV] = self.tag  # inherited by every Ray process started now, and only those
                try:
                    # Ray counts a node's CPUs in whole numbers; the bundles' fractions sum to any amount
                    _start_local(math.ceil(num_cpus or roles.cpus), self.tag, env)
                finally:
                    os.environ.pop(TAG_ENV, None)
            else:
                ray.init(address=address, namespace=self.tag, log_to_driver=False, runtime_env={"env_vars": env})
            self.groups: dict[str, PlacementGroup] = place(roles, self.tag, timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def serve_host(self) -> str:
        """Where the driver serves what actors fetch (updates): loopback locally, else this node's address."""
        return "127.0.0.1" if self.local else ray.util.get_node_ip_address()

    def slot(self, role: str, index: int = 0) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy of `role`'s `index`-th actor (role: trainer | engine | teacher | sandbox;
        the teacher's bundle is the engine bundle after the rollout engines')."""
        if role not in ("trainer", "engine", "teacher", "sandbox"):
            raise ValueError(f"role: expected trainer, engine, teacher or sandbox, got {role!r}")
        if role == "teacher":
            if index >= self.roles.teachers:
                raise ValueError(f"role teacher: the run placed {self.roles.teachers} teacher engines, not {index + 1}")
            role, index = "engine", self.roles.engines + index
        if role == "sandbox":
            group, bundle = self.groups["sandboxes"], index
        elif self.roles.placement == "colocated":
            group, bundle = self.groups["run"], index if role == "trainer" else self.roles.trainer_ranks + index
        else:
            group, bundle = self.groups["trainer" if role == "trainer" else "engines"], index
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)

    def close(self) -> None:
        """Remove the placement groups (their actors die with them), then stop a local cluster."""
        for group in getattr(self, "groups", {}).values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001, S110  # the cluster is going anyway
                pass
        self.groups = {}
        if ray.is_initialized():
            ray.shutdown()
        if self._watchdog is not None:
            self._watchdog.close()  # sweeps what ray.shutdown left (its agents)
            self._watchdog = None
