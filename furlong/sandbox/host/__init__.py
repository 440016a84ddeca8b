"""The sandbox host: furlong's own HTTP API (under /v1) over a local sandbox backend (docs/sandbox-hosts.md)."""
