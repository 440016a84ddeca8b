"""Image builds: buildah (full Dockerfiles) beside furlong's own subset, and sandbox start on each result.

    python bench/buildah_bench.py [--starts 10] [--out bench/results/buildah.json]

All in one run: the one-time import of the base into buildah's storage (into a scratch storage, so the
real one is untouched), a cold and a cached build of a 2-stage Dockerfile by buildah and of a one-stage
one by the native subset (a nonce makes each cold build new), and the median start (create + `true` +
close) of a sandbox on each image.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from provenance import finish, provenance

from furlong.sandbox.images import buildah
from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageStore

MULTI = """FROM furlong/base AS builder
RUN echo {nonce} > /built
FROM furlong/base
LABEL nonce={nonce}
COPY --from=builder /built /built
RUN echo done > /done
"""
SIMPLE = "FROM furlong/base\nRUN echo {nonce} > /built && echo done > /done\n"


def task(root: Path, name: str, text: str) -> Path:
    env = root / name / "environment"
    env.mkdir(parents=True)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


async def timed_build(root: Path, dockerfile: Path, backend) -> tuple[float, object]:
    started = time.perf_counter()
    ref = await ImageStore(root=root).image(dockerfile, backend)  # a new store: no in-memory answer
    return time.perf_counter() - started, ref


async def starts(backend, ref, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        box = await backend.create(SandboxSpec(image=ref))
        assert (await box.exec("true")).ok
        await box.close()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def main(n: int) -> dict:
    store = ImageStore()
    backend = BwrapBackend(layers=store)
    base = store.base()
    scratch = Path(tempfile.mkdtemp(dir=store.root.parent, prefix="bench-buildah-"))
    try:
        started = time.perf_counter()
        await asyncio.to_thread(buildah.Buildah(scratch).import_ref, base,
                                tuple(store.root / layer.path for layer in base.layers))
        import_s = time.perf_counter() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    nonce = uuid.uuid4().hex
    tasks = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    multi = task(tasks, "multi", MULTI.format(nonce=nonce))
    simple = task(tasks, "simple", SIMPLE.format(nonce=nonce))
    out: dict = {"base_import_into_buildah_s": import_s}
    for name, path in (("buildah", multi), ("native", simple)):
        cold, ref = await timed_build(store.root, path, backend)
        cached, _ = await timed_build(store.root, path, backend)
        out[name] = {"cold_s": cold, "cached_s": cached, "layers": len(ref.layers),
                     "start_median_ms": 1000 * await starts(backend, ref, n)}
    out["base_start_median_ms"] = 1000 * await starts(backend, base, n)
    shutil.rmtree(tasks, ignore_errors=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prov = provenance()
    result = asyncio.run(main(args.starts))
    result = {"provenance": finish(prov), **result}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
