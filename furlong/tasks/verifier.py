"""Runs a task's own tests in the episode's sandbox and reads the reward they write.

A Verdict without a reward, or an exception from a sandbox call here, is judged by the episode
runner (furlong.agent.runner): it runs the same tests in a fresh sandbox to tell a task bug
(`infra_error`) from an agent that kept them from scoring (`agent_broke_sandbox`, reward 0).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shlex
import tarfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from furlong.sandbox.base import BASE_ENV, ChangeTracking, ImageRef, Sandbox, SandboxDied, SandboxError
from furlong.sandbox.tarball import tar_dir
from furlong.tasks import integrity
from furlong.tasks.model import TESTS_DIR, VERIFIER_LOG_DIR, Task
from furlong.tasks.receipt import Receipt, bytes_digest, digest_tests

OUTPUT_TAIL_CHARS = 4000  # of a command's output kept in an episode's record: enough for a test report's end
BYTECODE_CHECK_S = 300.0  # for the interpreters to recompile the sources of the bytecode the agent changed
PYTHON_DIRS = ("/usr/local/bin", "/usr/bin", "/bin")  # where the Python trees' interpreters are
# Run as `python3.N -I -S -c BYTECODE_CHECK < paths`: prints each path (a `__pycache__` .pyc) that is its
# source's code (furlong.tasks.integrity, rule f) or that this interpreter never loads (another's magic or
# tag, no source beside it). Only builtins and frozen modules: nothing on disk the agent changed runs here.
BYTECODE_CHECK = """import marshal, sys
import _frozen_importlib_external as ext
for line in sys.stdin:
    pyc = line.rstrip("\\n")
    try:
        head, name = pyc.rsplit("/__pycache__/", 1)
        module, rest = name.split(".", 1)
        level = 2 if ".opt-2." in rest else 1 if ".opt-1." in rest else 0
        with open(pyc, "rb") as f:
            data = f.read()
        if data[:4] != ext.MAGIC_NUMBER or rest.split(".", 1)[0] != sys.implementation.cache_tag:
            print(pyc)
            continue
        try:
            with open(head + "/" + module + ".py", "rb") as f:
                source = f.read()
        except FileNotFoundError:
            print(pyc)
            continue
        if marshal.loads(data[16:]) == compile(source, head + "/" + module + ".py", "exec", dont_inherit=True,
                                               optimize=level):
            print(pyc)
    except Exception:
        pass
"""


def output_tail(stdout: str, stderr: str, cap: int = OUTPUT_TAIL_CHARS) -> str:
    """The end of stdout then the end of stderr, at most `cap` characters in all.

    Each stream keeps at least half of `cap` when both are long, so a failing test's report on stdout
    is not pushed out by a noisy stderr (or the reverse); a cut is marked so the reader knows.
    """
    if len(stdout) + len(stderr) <= cap:
        return stdout + stderr
    err_keep = min(len(stderr), max(cap // 2, cap - len(stdout)))
    out_keep = cap - err_keep
    return _end(stdout, out_keep) + _end(stderr, err_keep)


def _end(text: str, keep: int) -> str:
    if len(text) <= keep:
        return text
    room = keep - len(f"[... {len(text)} chars cut ...]\n")  # the marker's longest form fits in `keep`
    if room <= 0:
        return text[-keep:] if keep else ""
    return f"[... {len(text) - room} chars cut ...]\n" + text[-room:]


@dataclass(frozen=True)
class Verdict:
    reward: float | None  # None: the tests ran but left no usable reward (a task bug, not a score)
    rewards: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False
    exit_code: int | None = None
    output_tail: str = ""
    problem: str | None = None
    tampered_paths: tuple[str, ...] = ()  # what furlong.tasks.integrity counts (capped at MAX_LISTED)
    tampered: bool = False  # tampered_paths, and the task does not trust the agent's tools: reward 0
    tamper_checked: bool = False  # False: the sandbox cannot say what changed (a backend without ChangeTracking)
    # tamper_checked, and the tests ran as a verifier identity the agent cannot reach (verifier_uid not None)
    integrity_checked: bool = False
    reward_file: str | None = None  # the reward file read (reward.json or reward.txt); None: none was
    reward_digest: str | None = None  # of its bytes
    receipt: Receipt | None = None  # what the reward was computed from (furlong.tasks.receipt), set by `verify`


def verifier_env(task: Task, image: ImageRef | None = None) -> dict[str, str]:
    """What verifier commands get on top of the sandbox's environment (the image's): the image's
    `verifier_env` (the verifier toolchain's PATH and variables), then the task's own [verifier] env, which
    wins. With an image, PATH is always named (the sandbox's own, unless one of those sets it): the tamper
    check looks up commands in it."""
    env: dict[str, str] = {}
    if image is not None:
        env = {"PATH": dict(image.env).get("PATH", BASE_ENV["PATH"]), **dict(image.verifier_env)}
    return {**env, **dict(task.verifier_env)}


async def verify(
    task: Task,
    sandbox: Sandbox,
    workdir: str,
    verifier_uid: int | None = None,
    env: Mapping[str, str] | None = None,
    after_tests: Callable[[Verdict], Awaitable[None]] | None = None,
    tests: bytes | None = None,
    image: ImageRef | None = None,
) -> Verdict:
    """Copies the tests in (only now: the agent never saw them), runs them, returns the reward.

    What the tests execute is checked (furlong.tasks.integrity) before they run, and again after: the
    agent's background processes run on meanwhile, and anything they changed counts; what the verifier's
    own uid made does not (`verifier_uid`, as seen inside; None: the agent's uid, so every change counts).
    A tampered episode's tests still run, for the record, but it scores 0 unless the task trusts the
    agent's tools. `env` is the tests' environment on top of the sandbox's (`verifier_env`; by default
    without an image's), whose PATH (else the base one) the check searches. `after_tests(verdict)` (the user's
    reward functions, furlong.envs.rewards) runs once the tests have, inside the same check. `tests`: what goes in
    /tests, as a tar (a separate verifier's image may hold its own); None: the task's (`tests_tar`). `image`: the
    one the sandbox runs; its ENV's BASH_ENV, unless `env` sets one, is a start-up hook the check covers. The
    verdict's `receipt` records what the reward came from, the image's digest among it.

    Everything here runs as the verifier (`as_verifier`): /tests and /logs are its mounts, which the
    agent's processes, still running, can neither write nor replace (furlong.sandbox.runtime.bwrap). With one uid
    only (`sandbox.verifier_uid is None`) /tests and /logs are the agent's, as in earlier versions."""
    env = dict(env) if env is not None else verifier_env(task)
    search = integrity.path_dirs(env.get("PATH", BASE_ENV["PATH"]))
    hooks = integrity.shell_hooks({**BASE_ENV, **dict(image.env if image else ()), **env})
    tests = tests_tar(task) if tests is None else tests
    before = await _tampering(sandbox, search, None, hooks)
    verdict = await _run_tests(task, sandbox, workdir, env, tests)
    if after_tests is not None:
        await after_tests(verdict)
    after = await _tampering(sandbox, search, verifier_uid, hooks)
    if before is not None and after is not None:
        paths = integrity.listed(sorted(set(before) | set(after)))
        tampered = bool(paths) and not task.trust_agent_tools
        if tampered:
            verdict = dataclasses.replace(verdict, reward=0.0, rewards={"reward": 0.0}, problem=None)
        checked = sandbox.verifier_uid is not None  # the tests ran as an identity of their own
        verdict = dataclasses.replace(
            verdict, tampered_paths=paths, tampered=tampered, tamper_checked=True, integrity_checked=checked
        )
    return dataclasses.replace(verdict, receipt=_receipt(verdict, sandbox, tests, image.digest if image else ""))


def _receipt(verdict: Verdict, sandbox: Sandbox, tests: bytes, image_digest: str) -> Receipt:
    agent_uid = int(getattr(sandbox, "agent_uid", 0))
    return Receipt(
        image_digest=image_digest,
        tests_digest=digest_tests(tests),
        verifier_uid=agent_uid if sandbox.verifier_uid is None else sandbox.verifier_uid,
        agent_uid=agent_uid,
        exit_code=verdict.exit_code,
        reward_file=verdict.reward_file,
        reward_digest=verdict.reward_digest,
        tampered_paths=verdict.tampered_paths,
        tamper_checked=verdict.tamper_checked,
        backend=backend_name(sandbox),
    )


def backend_name(sandbox: object) -> str:
    """The backend of a sandbox, through the wrappers around it (each holds the one it wraps as `inner`)."""
    while (inner := getattr(sandbox, "inner", None)) is not None:
        sandbox = inner
    return str(getattr(sandbox, "backend", type(sandbox).__name__))


async def _tampering(
    sandbox: Sandbox, search: tuple[str, ...], verifier_uid: int | None, hooks: tuple[str, ...]
) -> tuple[str, ...] | None:
    """The paths the rule counts now, leaving out entries of `verifier_uid`; None without ChangeTracking."""
    if not isinstance(sandbox, ChangeTracking):
        return None
    changes = await sandbox.changes(integrity.scan_roots(search, hooks))
    if changes is None:
        return None
    if verifier_uid is not None:
        changes = tuple(c for c in changes if c.uid != verifier_uid)
    present = await sandbox.image_has(integrity.probe_paths(changes, search)) or frozenset()
    wanted = integrity.content_paths(changes, search, present.__contains__)
    contents = {path: await _read_or_none(sandbox, path) for path in wanted}
    faithful = await _faithful_bytecode(sandbox, integrity.bytecode_paths(changes))
    return integrity.tampered(changes, search, present.__contains__, contents.get, faithful.__contains__, hooks)


async def _faithful_bytecode(sandbox: Sandbox, paths: tuple[str, ...]) -> frozenset[str]:
    """Which of `paths` are their sources' code, as the interpreter each is tagged for compiles them, run as
    the verifier (the agent's processes can neither trace nor signal it). The interpreter is the image's, from
    the directories the Python trees' interpreters live in (never one the agent may have put first on a
    PATH); where there is none, none of its paths is faithful."""
    faithful: set[str] = set()
    dirs = " ".join(PYTHON_DIRS)
    for python, group in integrity.interpreters(paths).items():
        listing = "".join(f"{p}\n" for p in group)
        cmd = (
            f'for d in {dirs}; do if [ -x "$d/{python}" ]; then\n'
            f"exec \"$d/{python}\" -I -S -c {shlex.quote(BYTECODE_CHECK)} <<'FURLONG_BYTECODE'\n"
            f"{listing}FURLONG_BYTECODE\nfi; done; exit 127"
        )
        res = await sandbox.exec(cmd, timeout_s=BYTECODE_CHECK_S, cwd="/", as_verifier=True)
        if res.ok:
            faithful |= set(res.stdout.splitlines()) & set(group)
    return frozenset(faithful)


async def _read_or_none(sandbox: Sandbox, path: str) -> bytes | None:
    try:
        return await sandbox.read_file(path)
    except SandboxDied:
        raise
    except SandboxError:
        return None


def tests_tar(task: Task) -> bytes:
    """The task's tests as a tar for /tests: its tests directory, a step's own tests over it (Harbor merges
    both), and a Terminal-Bench script that lives beside them. Owner-only modes (0700 at most): they are the
    verifier's alone in a 0711 /tests, so an agent's process still running may not read the expected
    answers, even knowing the files' names."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for tests in (task.tests_dir, task.tests_overlay):
            if tests is not None:
                _append(tar, tar_dir(tests, mode_mask=0o700))
        if task.test_script.parent not in (task.tests_dir, task.tests_overlay):
            info = tarfile.TarInfo(task.test_script.name)
            data = task.test_script.read_bytes()
            info.size, info.mode = len(data), 0o700
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _append(tar: tarfile.TarFile, data: bytes) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as part:
        for member in part.getmembers():
            tar.addfile(member, part.extractfile(member) if member.isfile() else None)


async def _run_tests(task: Task, sandbox: Sandbox, workdir: str, env: dict[str, str], tests: bytes) -> Verdict:
    if sandbox.verifier_uid is None:  # one uid: whatever the agent left in /tests and /logs/verifier goes
        # /tests is a mount point: its contents go, it stays (the rm of the directory itself fails harmlessly)
        await sandbox.exec(
            f"rm -rf {TESTS_DIR} {VERIFIER_LOG_DIR} 2>/dev/null; mkdir -p {TESTS_DIR} {VERIFIER_LOG_DIR}", 30, cwd="/"
        )
    # else both are the verifier's own empty mounts: no program the agent may have replaced runs for them
    await sandbox.put_tar(tests, TESTS_DIR, as_verifier=True)
    script = f"{TESTS_DIR}/{task.test_script.name}"
    res = await sandbox.exec(
        f"bash {shlex.quote(script)}", timeout_s=task.verifier_timeout_s, cwd=workdir, env=env, as_verifier=True
    )
    tail = output_tail(res.stdout, res.stderr)
    if res.timed_out:
        return Verdict(
            reward=0.0,
            timed_out=True,
            exit_code=res.exit_code,
            output_tail=tail,
            problem=f"verifier timed out after {task.verifier_timeout_s:g}s",
        )
    (reward, rewards, problem), read = await _read_reward(sandbox)
    if reward is None and task.format == "terminal-bench":
        # Terminal-Bench 1.0 scores by the test run's success, not a reward file.
        reward, problem = (1.0 if res.exit_code == 0 else 0.0), None
    return Verdict(
        reward=reward,
        rewards=rewards,
        exit_code=res.exit_code,
        output_tail=tail,
        problem=problem,
        reward_file=read[0] if read else None,
        reward_digest=bytes_digest(read[1]) if read else None,
    )


Rewards = tuple[float | None, dict[str, float], str | None]


async def _read_reward(sandbox: Sandbox) -> tuple[Rewards, tuple[str, bytes] | None]:
    """The tests' reward: reward.json when they wrote one, else reward.txt (the order Harbor's verifier reads
    them in, so a task that writes both scores as it does there); and which file was read, with its bytes."""
    if (data := await _reward_file(sandbox, "reward.json")) is not None:
        return _json_rewards(data), ("reward.json", data)
    if (data := await _reward_file(sandbox, "reward.txt")) is None:
        return (None, {}, "the tests wrote neither reward.txt nor reward.json"), None
    raw = data.decode(errors="replace").strip()
    try:
        value = _finite(float(raw))
    except ValueError:
        return (None, {}, f"reward.txt is not a number: {raw[:80]!r}"), ("reward.txt", data)
    return (value, {"reward": value}, None), ("reward.txt", data)


async def _reward_file(sandbox: Sandbox, name: str) -> bytes | None:
    try:
        return await sandbox.read_file(f"{VERIFIER_LOG_DIR}/{name}", as_verifier=True)
    except SandboxDied:
        raise
    except SandboxError:
        return None  # not there (or not a regular file)


def _json_rewards(data: bytes) -> tuple[float | None, dict[str, float], str | None]:
    """A flat JSON object of numbers (as Harbor requires: a string such as "1" is no reward) with a 'reward' key."""
    try:
        parsed = json.loads(data)
        if not isinstance(parsed, dict):
            raise TypeError(f"the top level is {type(parsed).__name__}, not an object")
        rewards = {}
        for key, value in parsed.items():
            if not isinstance(value, (int, float)):
                raise TypeError(f"{key!r} is {value!r}, not a number")
            rewards[str(key)] = _finite(float(value))
    except (ValueError, TypeError) as exc:
        return None, {}, f"reward.json is not a flat map of numbers: {exc}"
    if "reward" not in rewards:
        return None, rewards, "reward.json has no 'reward' key"
    return rewards["reward"], rewards, None


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"reward must be finite, got {x}")
    return x
