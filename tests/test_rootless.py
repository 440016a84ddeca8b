"""furlong as an ordinary user: the base image builds without root, sandboxes get the delegated cgroup's
limits, and a missing prerequisite is one line. Run as root, the tests act through `runuser` as the CI
user (furlong-ci: created with a subuid range and delegated cgroups if missing, as .ci/run does); run as
an ordinary user, they check the same things directly."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

import as_user
import skips
from furlong.sandbox.runtime.cgroups import VERIFIER_PIDS

REPO = Path(__file__).resolve().parent.parent
CI_USER = "furlong-ci"
ROOT = os.geteuid() == 0
pytestmark = pytest.mark.timeout(900)


def _ensure_ci_user() -> None:
    try:
        pwd.getpwnam(CI_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", CI_USER], check=True)
    for kind in ("uid", "gid"):
        if not any(line.startswith(f"{CI_USER}:") for line in Path(f"/etc/sub{kind}").read_text().splitlines()):
            end = max([100000] + [int(a) + int(b) for _, a, b in
                                  (line.split(":") for line in Path(f"/etc/sub{kind}").read_text().split())])
            subprocess.run(["usermod", f"--add-sub{kind}s", f"{end}-{end + 65535}", CI_USER], check=True)
    subprocess.run([sys.executable, "-m", "furlong.cli", "sandbox", "delegate", "--user", CI_USER],
                   check=True, capture_output=True, cwd=REPO)


@pytest.fixture(scope="module")
def user() -> str | None:
    """The user to act as through runuser (root), or None to act directly (already an ordinary user)."""
    if not ROOT:
        return None
    _ensure_ci_user()
    return CI_USER


@pytest.fixture
def shared_tmp():
    """A temporary directory the other user can use too (pytest's own sit under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="furlong-rootless-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_as(user: str | None, argv: list[str], env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), **(env or {})}  # this checkout's furlong, whatever is installed
    if user is None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env={**os.environ, **env})
    return as_user.run(user, argv, timeout=timeout, cwd=REPO, env=env)


def furlong(user: str | None, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_as(user, [sys.executable, "-m", "furlong.cli", *args], env)


def python(user: str | None, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_as(user, [sys.executable, "-c", textwrap.dedent(code)], timeout=timeout)


def test_image_build_without_root(user):
    problem = python(user, "from furlong.sandbox.images import rootless; print(rootless.base_build_problem() or '')")
    if problem.stdout.strip():
        pytest.skip(f"this user cannot build images rootless here: {problem.stdout.strip()}")
    res = furlong(user, "image", "build")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "base image:" in res.stderr + res.stdout
    check = python(user, """
        import os
        from furlong.sandbox.images.store import ImageStore
        store = ImageStore()
        root = store.layer_dir(store.base().layers[0])
        print(os.stat(root / "etc").st_uid == os.getuid(), (root / "etc/apt/apt.conf.d/99furlong").exists(),
              (root / "logs").is_dir(), os.listdir(root / "var/cache/apt/archives"))
    """)
    assert check.stdout.split() == ["True", "True", "True", "['partial']"], check.stdout + check.stderr


def _one_error_line(res: subprocess.CompletedProcess, words: str) -> None:
    out = (res.stdout + res.stderr).strip()
    assert res.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], out


def test_missing_prerequisite_is_one_line(user, shared_tmp: Path):
    tmp_path = shared_tmp
    """Without mmdebstrap on PATH (an empty cache, so the base must be built) `furlong image build` and
    `furlong eval` each print one line naming the fix, with no traceback."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("tar", "sh", "env", "prlimit", "setpriv", "unshare", "cc", "as", "ld"):  # cc: the sandbox init
        (bin_dir / tool).symlink_to(subprocess.check_output(["sh", "-c", f"command -v {tool}"], text=True).strip())
    cache = tmp_path / "cache"
    task = tmp_path / "tasks" / "t"
    (task / "tests").mkdir(parents=True)
    (task / "instruction.md").write_text("nothing\n")
    (task / "task.toml").write_text("[agent]\ntimeout_sec = 10\n[verifier]\ntimeout_sec = 10\n")
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    for p in [tmp_path, *tmp_path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o777 if p.is_dir() else 0o755)
    env = {"PATH": str(bin_dir), "FURLONG_CACHE": str(cache)}
    _one_error_line(furlong(user, "image", "build", env=env), "apt-get install mmdebstrap")
    _one_error_line(furlong(user, "eval", "--tasks", str(task.parent), env=env), "apt-get install mmdebstrap")


@skips.needs_root("making a user without a subuid range needs root")
def test_no_subuid_range_is_one_line(shared_tmp: Path):
    tmp_path = shared_tmp
    name = f"furlong-t{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "-K", "SUB_UID_COUNT=0", "-K", "SUB_GID_COUNT=0", name],
                   check=True)
    try:
        res = furlong(name, "image", "build", env={"FURLONG_CACHE": str(tmp_path / "cache")})
        _one_error_line(res, "usermod --add-subuids")
        assert name in res.stdout + res.stderr
    finally:
        subprocess.run(["userdel", name], check=True)


FORK_BOMB = r"""
    import json, os, subprocess, sys, time, uuid
    from furlong.sandbox.runtime import cgroups
    from furlong.sandbox.base import Limits
    from furlong.sandbox.runtime.bwrap import bwrap_executable
    cg = cgroups.create("t" + uuid.uuid4().hex[:8], Limits(cpus=1.0, memory_mb=256, pids=40))
    if cg is None:
        print(json.dumps({"cgroup": None})); sys.exit()
    # What the launcher does for a non-root user: join the cgroup, then exec bwrap; and what the init does
    # for an agent command: move it into the agent's cgroup, whose pids limit is the Limits' one plus one
    # (for the child the init keeps waiting for the next command).
    join = " && ".join(f"echo $$ > {f}" for f in cg.procs_files + cg.agent_procs_files)
    bomb = ("import os, time\nn = 0\nfor i in range(300):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n        n += 1\n    except OSError:\n        pass\n"
            "print(n, flush=True); time.sleep(60)")
    proc = subprocess.Popen(["sh", "-c", join + ' && exec "$@"', "launch", bwrap_executable(), "--unshare-all",
                             "--unshare-user", "--uid", "0", "--gid", "0", "--die-with-parent",
                             "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "/usr/bin/python3", "-c", bomb],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    forked = int(proc.stdout.readline() or -1)  # the bomb has done its worst
    inside = len(cg.pids())
    pids_file = next(d for d in cg.dirs if (d / "pids.max").exists())
    user_procs = int(subprocess.check_output(["sh", "-c", f"ps -u {os.getuid()} --no-headers | wc -l"]))
    cg.remove()
    proc.wait(10)
    print(json.dumps({"cgroup": [str(d) for d in cg.dirs], "inside": inside, "forked": forked, "user_procs": user_procs,
                      "pids_max": (pids_file / "pids.max").read_text().strip() if pids_file.exists() else None,
                      "left": len(cg.pids()), "dirs_left": sum(d.exists() for d in cg.dirs)}))
"""


def test_fork_bomb_is_contained_by_the_delegated_cgroup(user):
    res = python(user, FORK_BOMB)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out["cgroup"] is None:
        pytest.skip("no delegated cgroup for this user (see `furlong sandbox delegate`)")
    assert 0 < out["forked"] < 41 and 0 < out["inside"] <= 41, out  # 300 asked for; pids.max (40 + 1) held
    assert out["user_procs"] < 100, out  # checked on the host: the user's processes, all sandboxes included
    assert out["left"] == 0 and out["dirs_left"] == 0, out


def test_sandbox_through_the_backend_is_limited(user):
    """The real backend as the user: a sandbox's fork bomb stays under its pids limit, counted on the host."""
    res = python(user, """
        import asyncio, json, subprocess
        from furlong.sandbox.base import Limits, SandboxSpec
        from furlong.sandbox.runtime.bwrap import BwrapBackend
        from furlong.sandbox.images.store import ImageStore
        async def main():
            store = ImageStore()
            box = await BwrapBackend(layers=store).create(SandboxSpec(image=store.base(), limits=Limits(pids=40)))
            try:
                await box.exec("true", 10)  # fully started: closing a half-started sandbox is another matter
                if box._cgroup is None:
                    return {"cgroup": None}
                r = await box.exec("for i in $(seq 300); do sleep 60 2>/dev/null & done 2>/dev/null; echo ok", 30)
                return {"cgroup": True, "inside": len(box._cgroup.pids()), "agent": len(box._cgroup.agent_pids()),
                        "out": r.stdout}
            finally:
                await box.close()
        print(json.dumps(asyncio.run(asyncio.wait_for(main(), 120))))
    """, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out["cgroup"] is None:
        pytest.skip("this user's sandbox got no cgroup: no delegated cgroup (see `furlong sandbox delegate`)")
    assert 0 < out["inside"] <= 40 + VERIFIER_PIDS and 0 < out["agent"] <= 40 + 1, out  # the init side keeps its room


def test_no_cgroup_warns_once(user):
    """A user without delegated cgroups is told, in one line, which limits still hold."""
    if user is not None:
        name = f"furlong-w{os.getpid() % 100000}"
        subprocess.run(["useradd", "--no-create-home", name], check=True)
    else:
        name = None
    try:
        res = python(name, "from furlong.sandbox.runtime import cgroups; print(cgroups.no_cgroup_warning() or '')")
        line = res.stdout.strip()
        if name is None and not line:
            # CI's ordinary user has one by design; as root the test makes a user without one
            skips.skip("root", "this user has a delegated cgroup: a user without one is made by root")
        assert len(line.splitlines()) == 1 and "RLIMIT_NPROC" in line and "no CPU cap" in line, res
    finally:
        if name:
            subprocess.run(["userdel", name], check=True)
