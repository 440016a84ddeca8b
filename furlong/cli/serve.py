"""`furlong sandbox` (delegate, tidy, serve) and `furlong openenv serve`: the host-side commands."""

from __future__ import annotations

import argparse

from furlong.cli.common import (
    build_base_image,
    config_of,
    console,
    sandbox_pieces,
)
from furlong.sandbox.base import SandboxError


def cmd_sandbox(args: argparse.Namespace) -> int:
    from furlong.sandbox.runtime.cgroups import delegate

    if args.sandbox_command == "tidy":
        return _tidy()
    if args.sandbox_command == "serve":
        return _serve(args)
    for d in delegate(args.user):
        print(d)
    console.print(f"{args.user} now gets per-sandbox cgroup limits when running furlong")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from furlong.paths import cache_dir
    from furlong.sandbox.host.serve import e2b_key, e2b_limits, serve
    from furlong.sync.serving import server_token

    if args.capacity < 1:
        raise SandboxError(f"--capacity: expected at least 1, got {args.capacity}")
    token = server_token(
        args.token_file, args.host, cache_dir() / "host-token", console.print, "sandbox.host_token_file"
    )
    key = None if args.e2b_key_file is None else e2b_key(args.e2b_key_file)
    given = {name: getattr(args, f"e2b_{name}") for name in ("cpus", "memory_mb", "disk_mb", "pids")}
    limits = e2b_limits(**given, lifetime_s=args.lifetime_s)
    cfg = config_of(args, {})
    if cfg.sandbox.backend != "bwrap":
        raise SandboxError(f"sandbox.backend={cfg.sandbox.backend}: a host serves its own (bwrap) sandboxes")
    backend, store = sandbox_pieces(cfg)
    serve(
        backend,
        store,
        token,
        host=args.host,
        port=args.port,
        capacity=args.capacity,
        idle_s=args.idle_s,
        lifetime_s=args.lifetime_s,
        say=console.print,
        e2b_api_key=key,
        allow_network=args.allow_network,
        e2b_limits=limits,
    )
    return 0


def _tidy() -> int:
    from furlong.paths import cache_dir
    from furlong.sandbox.base import DEFAULT_HOST_UID
    from furlong.sandbox.images import layers
    from furlong.sandbox.runtime import cgroups

    console.print(f"removed {cgroups.sweep_dead()} sandbox cgroups that dead furlong processes left")
    if not layers.supported():  # an ordinary user's sandboxes use the layers directly
        console.print("no image-layer views to detach: only root's sandboxes use them")
        return 0
    keep = layers.mount_point(cache_dir() / "images", DEFAULT_HOST_UID)  # the view sandboxes use by default
    with console.status("detaching image-layer views"):
        n = layers.detach_all_but(keep)
    console.print(f"detached {n} image-layer views; kept the image store's own ({keep})")
    return 0


def cmd_openenv(args: argparse.Namespace) -> int:
    from furlong.build.sandbox import network_default
    from furlong.envs.harbor import HarborEnv
    from furlong.eval.openenv_app import serve
    from furlong.paths import cache_dir
    from furlong.sandbox.images.store import ImageStore
    from furlong.sandbox.pool import FreshSandboxes, StoreImages
    from furlong.sync.serving import server_token
    from furlong.tasks.suite import load_suite

    if args.capacity < 1:
        raise ValueError(f"--capacity: expected at least 1, got {args.capacity}")
    token = server_token(args.token_file, args.host, cache_dir() / "openenv-token", console.print, "openenv.token_file")
    cfg = config_of(args, {})
    backend, store = sandbox_pieces(cfg)
    suite = load_suite(
        args.tasks, split=args.split, per_family=args.per_family, backend=backend, network=network_default(cfg.sandbox)
    )
    for broken in suite.broken:
        console.print(f"[yellow]not served:[/yellow] {broken.error}", soft_wrap=True)
    build_base_image(store)
    # this host's image store, where it is one: a separate verifier's image shows its own tests
    layers = store if isinstance(store, ImageStore) else None
    env = HarborEnv(FreshSandboxes(backend, StoreImages(store, backend)), layers=layers)
    serve(
        suite.tasks,
        env,
        token,
        host=args.host,
        port=args.port,
        capacity=args.capacity,
        idle_s=args.idle_s,
        allow_network=args.allow_network,
        say=console.print,
    )
    return 0
