"""Disk per buildah-made image: the bytes the store keeps for it, beside those of the base below it.

    python bench/buildah_layer_size.py [--before REV] [--out bench/results/buildah_layer_size.json]

Builds one 2-stage Dockerfile over the python:3.11-slim stand-in that adds a few small files (a nonce
makes the build new) in the default image store, and counts the bytes on disk (st_blocks, each inode
once) of the image's own directory (`<store>/buildah-<key>`) and of the layers its ImageRef stacks
below that directory (none when the image is one whole tree). With `--before REV`, the same build is
also measured with the furlong of commit REV (a `git clone` of this checkout in a temporary directory,
run as a subprocess), so one run gives the figure before and after. What a run built is removed from
the store and from buildah's storage afterwards (`--keep` keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from provenance import finish, provenance

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = """FROM python:3.11-slim AS build
RUN echo {nonce} > /built.txt

FROM python:3.11-slim
COPY --from=build /built.txt /app/built.txt
RUN pip --version > /app/pip.txt && rm /etc/debian_version
WORKDIR /app
"""


def disk_bytes(*dirs: Path) -> int:
    seen, total = set(), 0
    for top in dirs:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [".", *dirnames, *filenames]:
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def measure(keep: bool) -> dict:
    """Builds the Dockerfile with the furlong this interpreter imports and measures the stored image."""
    import furlong
    from furlong.sandbox.images.buildah import Buildah
    from furlong.sandbox.runtime.bwrap import BwrapBackend
    from furlong.sandbox.images.store import ImageStore

    store = ImageStore()
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "task" / "environment"
        env.mkdir(parents=True)
        (env / "Dockerfile").write_text(DOCKERFILE.format(nonce=uuid.uuid4().hex))
        started = time.perf_counter()
        ref = asyncio.run(store.image(env / "Dockerfile", BwrapBackend(layers=store)))
        seconds = time.perf_counter() - started
    own = store.root / ref.digest
    below = [store.root / layer.path for layer in ref.layers[1:]]
    found = {"furlong": str(Path(furlong.__file__).parent), "commit": _head(Path(furlong.__file__).parent),
             "key": ref.digest, "layers": len(ref.layers), "image_dir_bytes": disk_bytes(own),
             "below_bytes": disk_bytes(*below), "build_and_store_s": round(seconds, 2)}
    if not keep:
        shutil.rmtree(own)
        Buildah(store.root.parent / "buildah").run("rmi", f"localhost/furlong/{ref.digest}")
    return found


def _head(where: Path) -> str | None:
    res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def before(rev: str, keep: bool) -> dict:
    """measure() with the furlong of `rev`, from a clone of this checkout."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), tmp], check=True)
        subprocess.run(["git", "-C", tmp, "checkout", "-q", rev], check=True)
        code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import buildah_layer_size as b; " \
               f"print(json.dumps(b.measure({keep!r})))"
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": tmp}, check=True)
        return json.loads(res.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="also measure the furlong of this commit")
    parser.add_argument("--keep", action="store_true", help="keep the images built")
    parser.add_argument("--out", type=Path, help="write the JSON here (e.g. bench/results/buildah_layer_size.json)")
    args = parser.parse_args()
    prov = provenance(ROOT)
    sys.path.insert(0, str(ROOT))  # this checkout's furlong, whatever is installed
    after = measure(args.keep)
    earlier = before(args.before, args.keep) if args.before else None
    text = json.dumps({"dockerfile": DOCKERFILE, "after": after, "before": earlier, "provenance": finish(prov)},
                      indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
