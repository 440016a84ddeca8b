"""The client side of sandbox hosts: the `remote` backend, whose sandboxes run on `furlong sandbox serve`
hosts (furlong.sandbox.host) through their /v1 API.

backend.py is the backend (RemoteBackend: each sandbox on one host, its calls over HTTP); hosts.py the hosts
it spreads sandboxes over, with their token (config sandbox.hosts, sandbox.host_token_file); images.py the
images its tasks need, built or pulled on the hosts themselves (HostImages) rather than here. With host/
(the server) and e2b/ (an E2B-compatible API on the same server) this is the serving side: it may import
the runtime and the image side, and neither imports it (docs/sandbox-hosts.md).
"""
