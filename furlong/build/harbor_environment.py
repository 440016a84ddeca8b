"""`harbor run --environment-import-path furlong.build.harbor_environment:FurlongEnvironment`: harbor's
trials in furlong sandboxes, no Docker (docs/harbor.md). Needs the `harbor` package (0.25.0, Python 3.12+).

A thin adapter: the decisions live in furlong.build.harbor_box.HarborBox. Options come as harbor's
`--ek key=value`: `recipe` (a furlong recipe) and `overrides` (comma-separated `key=value`, e.g.
`sandbox.seccomp=true`; a YAML list keeps its commas), so the backend is the one `sandbox.backend` names.
"""

from __future__ import annotations

from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkPolicy as HarborPolicy

from furlong.build.harbor_box import harbor_box, split_overrides, task_dir_of
from furlong.sandbox.network import NetworkPolicy, policy

TYPE = "furlong"


class FurlongEnvironment(BaseEnvironment):
    def __init__(self, *args, recipe: str | None = None, overrides: str = "", **kwargs):
        self._recipe = recipe
        self._overrides = split_overrides(overrides)
        super().__init__(*args, **kwargs)  # validates the definition and the network policy
        phases = tuple(_ours(p) for p in self._phase_network_policies)
        self._box = harbor_box(
            self.environment_dir, _ours(self._network_policy), phases, recipe=recipe, overrides=self._overrides
        )

    @staticmethod
    def type() -> str:
        return TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # every network mode and allowlist entry, switched while the sandbox runs; no GPUs, no host mounts
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv6_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            network_allowlist_ipv6_cidrs=True,
            dynamic_network_policy=True,
        )

    async def _apply_network_policy(self, network_policy: HarborPolicy) -> None:
        await self._box.set_network(_ours(network_policy))

    def _validate_definition(self):
        task_dir_of(self.environment_dir)
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError(
                f"{self.environment_dir}: docker-compose tasks are not supported by furlong "
                "(one sandbox per trial); expected environment/Dockerfile or none"
            )

    async def start(self, force_build: bool) -> None:
        await self._box.start()

    async def stop(self, delete: bool):
        await self._box.stop()

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        res = await self._box.exec(
            command, cwd=cwd, env=self._merge_env(env), timeout_sec=timeout_sec, user=self._resolve_user(user)
        )
        return ExecResult(stdout=res.stdout, stderr=res.stderr, return_code=res.return_code)

    async def upload_file(self, source_path: Path | str, target_path: str):
        await self._box.upload_file(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str):
        await self._box.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str):
        await self._box.download_file(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str):
        await self._box.download_dir(source_dir, target_dir)

    async def empty_dirs(self, dirs, *, chmod: bool = True):
        """harbor's, but the verifier's own directories stay its own (HarborBox.empty_verifier_dirs)."""
        own = [str(d) for d in dirs if self._box.verifier_owned(str(d))]
        others = [d for d in dirs if str(d) not in own]
        result = await super().empty_dirs(others, chmod=chmod) if others else None
        if own:
            res = await self._box.empty_verifier_dirs(own)
            result = ExecResult(stdout=res.stdout, stderr=res.stderr, return_code=res.return_code)
        return result


def _ours(harbor_policy: HarborPolicy) -> NetworkPolicy:
    return policy(harbor_policy.network_mode.value, harbor_policy.allowed_hosts)
