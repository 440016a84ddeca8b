"""Every versioned stand-in built cold, its real version probed, one command run in it without network; and
Terminal-Bench 2's test forms offline on the python:3.13 stand-in with the verifier toolchain, in a sandbox
and through `furlong eval` (oracle and no-op) of two tasks-tb2 tasks moved onto python:3.13 and python:3.12.
The Ubuntu stand-ins (images.ubuntu_standins=nearest) each build TB2's usual `FROM ubuntu:X` Dockerfile.

    python bench/standins_check.py [--only python,gcc,ubuntu] [--keep] [--out bench/results/standins.json]

Builds go into a scratch image store beside the user's (both Debian bases included, so the times are cold
ones; removed at the end unless --keep). Each stand-in is asked for through `ImageStore.parent` with a tag
naming its version, as a Dockerfile's FROM would; where no registry answers (as here) that is the stand-in.
Needs root or a subordinate id range (mmdebstrap), the Debian mirror, and PyPI for the toolchain's wheels.
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
from pathlib import Path

from provenance import ROOT, finish, provenance

from furlong.paths import cache_dir
from furlong.sandbox.images import standins, toolchain, ubuntu
from furlong.sandbox.base import Limits, SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.images.registry import RegistryError
from furlong.sandbox.images.standin_recipes import FAMILIES

# one command per family: compile or run something small, offline, and print the versions it sees
COMMANDS = {
    "python": "python --version && pip --version | cut -d' ' -f1,2 && python -m venv /tmp/v "
              "&& /tmp/v/bin/python -c 'print(1)'",
    "gcc": "cd /tmp && echo '#include <stdio.h>' > h.c && echo 'int main(void) { printf(\"gcc %d.%d\\n\", "
           "__GNUC__, __GNUC_MINOR__); }' >> h.c && gcc -O2 h.c -o h && ./h && g++ --version | head -1 "
           "&& gfortran --version | head -1 && make --version | head -1",
    "golang": "cd /tmp && mkdir m && cd m && go mod init example.com/m 2>/dev/null && printf 'package main\\nimport "
              "\"fmt\"\\nfunc main() { fmt.Println(\"hello from go\") }\\n' > main.go && go build -o m . && ./m "
              "&& head -3 go.mod | tail -1 && echo GOPATH=$GOPATH GOTOOLCHAIN=$GOTOOLCHAIN",
    "node": "node -e 'console.log(\"node\", process.version)' && npm --version",
    "rust": "cd /tmp && cargo new -q hello && cd hello && cargo build -q --offline && ./target/debug/hello "
            "&& cargo --version",
    "openjdk": "cd /tmp && printf 'public class H { public static void main(String[] a) { System.out.println(\"java \" "
               "+ System.getProperty(\"java.version\")); } }\\n' > H.java && javac H.java && java -cp . H "
               "&& ls $JAVA_HOME/bin/javac",
}
# TB2's usual Ubuntu task image, and what its tasks then run: a C build, pip into the system Python
UBUNTU_TASK = ("FROM {tag}\nENV DEBIAN_FRONTEND=noninteractive\nRUN apt-get update && apt-get install -y python3 "
               "python3-pip python3-venv curl build-essential && rm -rf /var/lib/apt/lists/*\nWORKDIR /app\n")
UBUNTU_CHECK = ("pwd && cd /tmp && printf '#include <stdio.h>\\nint main(void) { printf(\"gcc %%d.%%d\\\\n\", "
                "__GNUC__, __GNUC_MINOR__); }\\n' > h.c && gcc h.c -o h && ./h && python3 --version && "
                "(id ubuntu || true) && python3 -c 'import sysconfig, os; print(\"EXTERNALLY-MANAGED\", "
                "os.path.exists(sysconfig.get_path(\"stdlib\") + \"/EXTERNALLY-MANAGED\"))' && "
                "echo PIP_BREAK_SYSTEM_PACKAGES=$PIP_BREAK_SYSTEM_PACKAGES && . /etc/os-release && echo $PRETTY_NAME")
TB2 = """set -e
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
mkdir -p /tmp/logs /tmp/t && cd /tmp/t
printf 'import sys\\ndef test_v():\\n    assert sys.version_info[:2] == (3, 13)\\n' > test_outputs.py
uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /tmp/logs/ctrf.json test_outputs.py -rA | tail -1
python3 -c 'import json; print("ctrf", json.load(open("/tmp/logs/ctrf.json"))["results"]["summary"]["passed"])'
uv venv -q -p 3.13 /tmp/venv && . /tmp/venv/bin/activate && uv pip install -q pytest==8.4.1 && uv run pytest -q test_outputs.py | tail -1
deactivate
mkdir /tmp/proj && cd /tmp/proj && uv init -q && uv add -q pytest==8.4.1 && uv run --python 3.13 pytest -q /tmp/t/test_outputs.py | tail -1
uvx -p 3.12 pytest --version 2>&1 | head -1
"""


async def run_in(backend, image, cmd: str, verifier: bool = False) -> dict:
    """`cmd` in a sandbox without network; `verifier`: as the verifier, with the image's verifier_env (the toolchain)."""
    box = await backend.create(SandboxSpec(image=image, limits=Limits(memory_mb=4096, pids=1024)))  # no network
    try:
        env = dict(image.verifier_env) if verifier else None
        res = await box.exec(cmd, timeout_s=600, env=env, as_verifier=verifier)
    finally:
        await box.close()
    return {"command": cmd, "exit_code": res.exit_code, "output": (res.stdout + res.stderr).strip()[-3000:]}


async def one(store, backend, repo: str, offer) -> dict:
    tag = f"{repo}:{offer.version}"
    started = time.monotonic()
    image = await store.parent(tag, backend, lambda _: None)
    meta = json.loads((store.root / image.digest / "meta.json").read_text())
    probed = meta.get("provides", "")
    row = {"tag": tag, "standin": offer.name, "suite": offer.suite, "packages": list(offer.packages),
           "version": offer.version, "probed": probed, "matches": probed.split(".")[:len(offer.version.split("."))]
           == offer.version.split("."), "build_s": round(time.monotonic() - started, 1), "note": image.note}
    return {**row, **await run_in(backend, image, COMMANDS["openjdk" if repo == "eclipse-temurin" else repo])}


async def tb2(store, backend) -> list[dict]:
    """The python:3.13 stand-in (and python:3.12's, the nearest) with the toolchain, no network: TB2's tests."""
    tc = await toolchain.build(store, backend)
    rows = []
    for tag in ("python:3.13-slim-bookworm", "python:3.12-slim"):
        image = toolchain.stack(await store.parent(tag, backend, lambda _: None), tc, network=False)
        rows.append({"tag": tag, "note": image.note, **await run_in(backend, image, TB2, verifier=True)})
    return rows


def eval_tb2(root: Path) -> dict:
    """`furlong eval` (oracle, then no-op) of two tasks-tb2 tasks moved onto python:3.13 and python:3.12 with
    TB2's `-p 3.13`: the verifier, as its own uid and without network, runs TB2's test forms."""
    tasks = root / "tasks"
    for name, tag in (("pytest-toolchain", "python:3.13-slim-bookworm"), ("uvx-ctrf", "python:3.12-slim")):
        shutil.copytree(ROOT / "tasks-tb2" / name, tasks / name)
        dockerfile = tasks / name / "environment/Dockerfile"
        lines = dockerfile.read_text().splitlines(keepends=True)
        dockerfile.write_text("".join(f"FROM {tag}\n" if line.startswith("FROM ") else line for line in lines))
        test = tasks / name / "tests/test.sh"
        test.write_text(test.read_text().replace("-p 3.11", "-p 3.13").replace("uv venv ", "uv venv -p 3.13 "))
    out = {}
    for agent in ("oracle", "noop"):
        lines = root / f"{agent}.jsonl"
        subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(tasks), "--agent", agent,
                        "--out", str(lines)], cwd=ROOT, env={**os.environ, "FURLONG_CACHE": str(root)},
                       capture_output=True, timeout=1800, check=False)
        records = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
        out[agent] = {r["task"]: {"reward": r["reward"], "status": r["status"], "error": r.get("error"),
                                  "image_note": r.get("image_note")} for r in records}
    return out


async def ubuntu_rows(store, backend, root: Path) -> list[dict]:
    """Each Ubuntu release's stand-in on its nearest Debian release, and TB2's usual task image on it."""
    rows = []
    for rel in ubuntu.RELEASES:
        tag = f"ubuntu:{rel.version}"
        started = time.monotonic()
        try:
            image = await store.parent(tag, backend, lambda _: None)
            standin_s = round(time.monotonic() - started, 1)
            dockerfile = root / "ubuntu" / rel.name / "environment/Dockerfile"
            dockerfile.parent.mkdir(parents=True)
            dockerfile.write_text(UBUNTU_TASK.format(tag=tag))
            started = time.monotonic()
            task = await store.image(dockerfile, backend, lambda _: None)
        except (RegistryError, OSError, RuntimeError) as exc:
            rows.append({"tag": tag, "error": str(exc)[-2000:]})
            continue
        meta = json.loads((store.root / image.digest / "meta.json").read_text())
        rows.append({"tag": tag, "standin": meta["standin"], "suite": rel.suite, "probed": meta.get("provides", ""),
                     "standin_s": standin_s, "task_layer_s": round(time.monotonic() - started, 1),
                     "note": image.note, **await run_in(backend, task, UBUNTU_CHECK)})
        print(json.dumps(rows[-1])[:300], flush=True)
    return rows


def refusals() -> list[dict]:
    """What exact mode (and Go in any mode) says for versions Debian lacks: one line each."""
    out = []
    for mode, tag in (("exact", "python:3.12-slim"), ("exact", "node:22"), ("nearest", "golang:1.20")):
        choice = standins.resolve(tag)
        out.append({"mode": mode, "tag": tag, "allowed": choice.allowed(mode), "error": choice.refusal(mode)})
    off = standins.resolve("ubuntu:24.04")  # images.ubuntu_standins=off, the default
    out.append({"mode": "ubuntu_standins=off", "tag": "ubuntu:24.04", "allowed": off.allowed("nearest"),
                "error": off.refusal("nearest")})
    return out


async def main(only: set[str], keep: bool) -> dict:
    root = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="bench-standins-"))
    root.chmod(0o755)  # build sandboxes (the sandbox uid) write layers under it by path
    store = ImageStore(root=root / "images", ubuntu_standins="nearest")
    backend = BwrapBackend(layers=store)
    try:
        bases = {}
        for suite in standins.SUITES:
            started = time.monotonic()
            store.base(None, suite)
            bases[suite] = round(time.monotonic() - started, 1)
        rows = []
        for repo, family in FAMILIES.items():
            if repo == "eclipse-temurin" or (only and repo not in only):
                continue  # temurin's stand-ins are openjdk's
            for offer in family.offers:
                try:
                    rows.append(await one(store, backend, repo, offer))
                except (RegistryError, OSError, RuntimeError) as exc:
                    rows.append({"tag": f"{repo}:{offer.version}", "standin": offer.name, "error": str(exc)[-2000:]})
                print(json.dumps(rows[-1])[:300], flush=True)
        python = not only or "python" in only
        checks = await tb2(store, backend) if python else []
        evals = await asyncio.to_thread(eval_tb2, root) if python else {}
        ubuntus = await ubuntu_rows(store, backend, root) if not only or "ubuntu" in only else []
        return {"bases_s": bases, "standins": rows, "tb2_offline": checks, "tb2_eval": evals, "ubuntu": ubuntus,
                "refusals": refusals()}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated families (python,gcc,golang,node,rust,openjdk,"
                                                   "ubuntu)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch store (printed)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prov = provenance()
    result = asyncio.run(main({f for f in args.only.split(",") if f}, args.keep))
    result = {"provenance": finish(prov), **result}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
