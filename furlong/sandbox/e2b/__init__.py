"""An E2B-compatible API over a furlong SandboxBackend: the control plane (REST) and envd's data plane
(health, files, commands with input, PTYs and reattaching, the filesystem service and its watchers), so the
real `e2b` SDK can drive furlong sandboxes. See docs/e2b.md."""

from furlong.sandbox.e2b.app import e2b_app

__all__ = ["e2b_app"]
