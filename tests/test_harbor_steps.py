"""Harbor's separate verifier environments and multi-step tasks, loaded as Harbor resolves them and run
through `furlong eval`'s entry (run_eval) in real sandboxes: the fixtures in tests/fixtures/harbor."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import run
from rich.console import Console

from furlong.agent.runner import AgentRun
from furlong.build.harbor_box import HarborBox, box_task
from furlong.envs.separate import BundledTests
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.run import run_eval
from furlong.sandbox.pool import StoreImages
from furlong.tasks import artifacts
from furlong.tasks.loader import load_task
from furlong.tasks.model import Artifact, TaskError
from furlong.train.sft import demonstrable

FIXTURES = Path(__file__).parent / "fixtures" / "harbor"
SEPARATE, STEPS = FIXTURES / "separate-verifier", FIXTURES / "multi-step"


def copy(tmp_path: Path, fixture: Path, **edits: str) -> Path:
    """The fixture copied under tmp_path, with files (relative path -> text) replaced."""
    dest = tmp_path / fixture.name
    shutil.copytree(fixture, dest)
    for rel, text in edits.items():
        (dest / rel).write_text(text)
    return dest


class Commands:
    """A scripted agent: the k-th agent phase of the episode (its k-th step) runs commands[k] as the agent."""

    name = "commands"

    def __init__(self, *commands: str):
        self.commands, self.phase = commands, 0

    async def run(self, task, tools, timeout_s):
        command = self.commands[self.phase] if self.phase < len(self.commands) else "true"
        self.phase += 1
        res = await tools.sandbox.exec(command, timeout_s=timeout_s)
        return AgentRun(commands=1, last_exit_code=res.exit_code, last_output=res.stdout + res.stderr)


def evaluate(backend, store, agent, *task_dirs: Path, out: Path | None = None):
    tasks = [load_task(d) for d in task_dirs]
    return run(run_eval(tasks, agent, backend, store, 2, out, Console(quiet=True)))


# --- loading: Harbor's resolution, and one-line refusals of what furlong cannot run -------------------

def test_fixtures_resolve_as_harbor_does():
    sep = load_task(SEPARATE)
    assert sep.separate is not None and sep.separate.bundled_tests
    assert sep.separate.dockerfile == SEPARATE / "tests" / "Dockerfile"
    assert [a.source for a in artifacts.entries(sep)] == ["/logs/artifacts", "/app/answer.txt"]
    steps = load_task(STEPS)
    assert [s.name for s in steps.steps] == ["create", "extend", "publish"]
    assert steps.instruction == steps.steps[0].instruction and steps.reward_strategy == "mean"
    create, extend, publish = steps.steps
    assert create.min_reward == (("reward", 1.0),) and extend.min_reward is None
    assert extend.workdir == STEPS / "steps" / "extend" / "workdir" and create.workdir is None
    assert create.separate is None and publish.separate is not None and not publish.separate.bundled_tests
    assert publish.separate.dockerfile == STEPS / "environment" / "Dockerfile"  # a fresh sandbox of the task's image
    # a step's own [verifier] timeout_sec, as Harbor's (600 unless given), never the task's
    assert (create.verifier_timeout_s, publish.verifier_timeout_s) == (600.0, 60.0)
    assert create.agent_timeout_s == 60.0 and create.solution == STEPS / "steps/create/solution/solve.sh"
    assert demonstrable(sep) and not demonstrable(steps)  # an SFT demonstration is one instruction, one call


def test_verifier_environment_implies_separate_and_sets_its_limits(tmp_path: Path):
    d = copy(tmp_path, SEPARATE)
    (d / "tests" / "Dockerfile").unlink()
    toml = (d / "task.toml").read_text().replace('environment_mode = "separate"\n', "")
    (d / "task.toml").write_text(toml + "\n[verifier.environment]\ncpus = 2\nmemory_mb = 1024\n")
    task = load_task(d)
    assert task.separate is not None and not task.separate.bundled_tests
    assert (task.separate.limits.cpus, task.separate.limits.memory_mb) == (2.0, 1024)
    assert task.separate.dockerfile == d / "environment" / "Dockerfile"


STEP = '[[steps]]\nname = "one"\n'
REFUSALS = {
    "compose verifier": ({"tests/docker-compose.yaml": "services: {}\n"}, '[verifier]\nenvironment_mode = "separate"\n',
                         "docker-compose verifier environment"),
    "sidecar artifact": ({}, 'artifacts = [{source = "/db", service = "db"}]\n', "field 'artifacts': service 'db'"),
    "sidecar hook": ({}, '[[verifier.collect]]\ncommand = "x"\nservice = "db"\n', "field 'verifier.collect'"),
    "shared with an environment": ({}, '[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1\n',
                                   "field 'verifier': Value error, environment_mode = 'shared' contradicts"),
    "prebuilt verifier image": ({}, '[verifier.environment]\ndocker_image = "x:1"\n',
                                "field 'verifier.environment.docker_image'"),
    "the verifier's own path": ({}, 'artifacts = ["/logs/verifier/reward.txt"]\n', "is the verifier's own"),
    "a path climbing out": ({}, 'artifacts = ["/app/../tests"]\n', "field 'artifacts.0.source'"),
    "step names twice": ({"steps/one/instruction.md": "x"}, STEP + STEP.replace("one", "ONE"), "is used twice"),
    "a step name with a slash": ({}, '[[steps]]\nname = "a/b"\n', "field 'steps.0.name'"),
    "a step without its directory": ({}, STEP, "steps/one: missing"),
    "a step without tests": ({"steps/one/instruction.md": "x"}, STEP, "steps/one/tests/test.sh: missing"),
    "an unknown step key": ({}, STEP + "timeout = 3\n", "unknown key 'steps.0.timeout'"),
    "a windows verifier": ({}, '[verifier.environment]\nos = "windows"\n', "field 'verifier.environment.os'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_furlong_cannot_run_is_refused_by_name(tmp_path: Path, case: str):
    files, toml, expected = REFUSALS[case]
    d = tmp_path / "t"
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text("x")
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    if case != "a step without tests":
        (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (d / "task.toml").write_text(toml)
    with pytest.raises(TaskError) as err:
        load_task(d)
    assert expected in str(err.value) and "\n" not in str(err.value)


# --- artifacts are hostile input: what may go into the verifier's sandbox -----------------------------

def _tar(*members: tuple[str, str, str | bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, arg in members:
            info = tarfile.TarInfo(name)
            info.type = {"dir": tarfile.DIRTYPE, "file": tarfile.REGTYPE, "link": tarfile.SYMTYPE,
                         "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            info.mode = 0o6777
            if kind == "file":
                info.size = len(arg)
                tar.addfile(info, io.BytesIO(arg))
            else:
                info.linkname = arg or ""
                tar.addfile(info)
    return buf.getvalue()


def test_artifact_archives_keep_only_what_stays_inside_them():
    root = "logs/artifacts"
    data = _tar((root, "dir", None), (f"{root}/a.txt", "file", b"a"), (f"{root}/sub", "dir", None),
                (f"{root}/sub/up", "link", ".."), (f"{root}/via", "link", "sub"),
                (f"{root}/ok", "link", "sub/../a.txt"), (f"{root}/copy", "hard", f"{root}/a.txt"),
                # each of these would lead the tests out of the artifact (to /tests' expected answers)
                (f"{root}/abs", "link", "/tests/expected.txt"), (f"{root}/climb", "link", "../verifier/reward.txt"),
                (f"{root}/chain", "link", "via/up/.."), (f"{root}/out", "hard", "etc/passwd"),
                (f"{root}/fifo", "fifo", None), ("etc/passwd", "file", b"x"), (f"{root}/../../etc/x", "file", b"x"))
    kept = artifacts.checked(Artifact("/logs/artifacts"), data)
    with tarfile.open(fileobj=io.BytesIO(kept.tar)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {root, *(f"{root}/{n}" for n in ("a.txt", "sub", "sub/up", "via", "ok", "copy"))}
        assert all(m.mode & 0o7022 == 0 for m in members.values())  # no setuid/setgid/sticky, no g/o write
        assert tar.extractfile(members[f"{root}/copy"]).read() == b"a"  # a hard link inside becomes a copy
    # an entry that is itself a symlink is left out: it would point the tests at the verifier's files
    assert artifacts.checked(Artifact("/app/answer.txt"), _tar(("app/answer.txt", "link", "expected.txt"))) is None
    with pytest.raises(artifacts.ArtifactsError):
        artifacts.checked(Artifact("/app/x"), b"not a tar at all" * 64)


# --- episodes in real sandboxes -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def oracle_and_noop(backend, store, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "oracle.jsonl"
    return (evaluate(backend, store, OracleAgent(), SEPARATE, STEPS, out=out),
            evaluate(backend, store, NoopAgent(), SEPARATE, STEPS), out)


def test_oracle_scores_one_and_noop_zero(oracle_and_noop):
    oracle, noop, out = oracle_and_noop
    assert [(r.task, r.reward, r.status) for r in oracle] == [("separate-verifier", 1.0, "ok"),
                                                              ("multi-step", 1.0, "ok")]
    assert [(s.name, s.reward) for s in oracle[1].steps] == [("create", 1.0), ("extend", 1.0), ("publish", 1.0)]
    assert [(r.reward, r.status) for r in noop] == [(0.0, "ok"), (0.0, "ok")]
    assert "no report in /logs/artifacts" in noop[0].verifier_output
    # the first step's min_reward stops the rest
    assert [(s.name, s.reward) for s in noop[1].steps] == [("create", 0.0)] and "min_reward" in noop[1].error
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    steps = next(r["steps"] for r in lines if r["task"] == "multi-step")
    assert steps == [{"name": n, "reward": 1.0, "rewards": {"reward": 1.0}, "error": None}
                     for n in ("create", "extend", "publish")]


def test_each_step_and_a_separate_verifier_have_receipts_that_verify(oracle_and_noop, backend, store):
    """A receipt per step, named; the separate verifier's names its own image. Rechecked against the fixtures
    as they are, every receipt is ok (the tests a verifier image holds, and each step's tests)."""
    from furlong.eval.receipts import TaskFinder, check_file

    oracle, _, out = oracle_and_noop
    sep, steps = oracle
    assert [r.step for r in steps.receipts] == ["create", "extend", "publish"]
    assert len({r.tests_digest for r in steps.receipts}) == 3 and all(not r.tampered_paths for r in steps.receipts)
    (receipt,) = sep.receipts
    assert receipt.step is None and receipt.tamper_checked and receipt.backend == "bwrap"
    checks = run(check_file(out, TaskFinder(FIXTURES, backend), StoreImages(store, backend), BundledTests(store)))
    assert [(c.task, c.step, c.verdict) for c in checks] == [
        ("separate-verifier", None, "ok"), *(("multi-step", n, "ok") for n in ("create", "extend", "publish"))
    ], checks


def test_reward_strategies_mean_and_final(backend, store, tmp_path: Path):
    """Steps one and two done, three (published artifacts) not: the mean is 2/3, the final step's 0."""
    solve = ("echo one > /app/notes.txt", "cat /app/extra.txt >> /app/notes.txt", "true")
    toml = (STEPS / "task.toml").read_text()
    final = copy(tmp_path, STEPS, **{"task.toml": toml.replace('"mean"', '"final"')})
    mean, last = (evaluate(backend, store, Commands(*solve), d)[0] for d in (STEPS, final))
    assert [s.reward for s in mean.steps] == [1.0, 1.0, 0.0] == [s.reward for s in last.steps]
    assert (mean.reward, last.reward) == (pytest.approx(2 / 3), 0.0)


def test_a_symlink_to_the_tests_answer_is_not_an_answer(backend, store):
    """The agent points its artifact at the verifier's expected answer (which the tests compare it with):
    the link is left out of what the verifier's sandbox gets, so the answer is missing."""
    attack = ("echo report > /logs/artifacts/report.txt; ln -s /tests/expected.txt /app/answer.txt; "
              "ln -s /tests /logs/artifacts/tests")
    res = evaluate(backend, store, Commands(attack), SEPARATE)[0]
    assert (res.reward, res.status) == (0.0, "ok") and "wrong or no answer" in res.verifier_output


def test_artifacts_the_agent_keeps_from_collection_score_zero(backend, store):
    """An artifact the agent made unreadable (to itself, as it packs them) fails the collection; the same
    collection where no agent ran works, so the failure is the agent's: scored 0, never unscored."""
    res = evaluate(backend, store, Commands("echo x > /logs/artifacts/r.txt; chmod 000 /logs/artifacts/r.txt"),
                   SEPARATE)[0]
    assert (res.reward, res.status) == (0.0, "agent_broke_sandbox") and "artifacts" in res.error


def test_the_tests_that_run_are_the_ones_the_verifier_image_holds(backend, store, tmp_path: Path):
    """tests/Dockerfile copies two files of the tests directory to /tests: only those are there (read from
    the image's layers: /tests is a verifier mount in the sandbox, which hides the image's own)."""
    test = (SEPARATE / "tests" / "test.sh").read_text().replace(
        "echo 0 > /logs/verifier/reward.txt\n", "echo 0 > /logs/verifier/reward.txt\ntest ! -e /tests/Dockerfile || exit 1\n")
    d = copy(tmp_path, SEPARATE, **{"tests/test.sh": test, "tests/Dockerfile": "FROM debian:bookworm-slim\n"
                                    "WORKDIR /app\nCOPY test.sh expected.txt /tests/\n"})
    assert [(r.reward, r.status) for r in evaluate(backend, store, OracleAgent(), d)] == [(1.0, "ok")]
    # harbor's hook: the separate verifier's environment (<task>/tests) is that image, its tests in /tests,
    # and harbor's default user there is the verifier (no agent runs in it)
    task, bundled = box_task(load_task(d), d / "tests")
    assert bundled and task.dockerfile == d / "tests" / "Dockerfile"
    box = HarborBox(task, backend, StoreImages(store, backend), bundled=BundledTests(store))

    async def listing() -> tuple[str, bool]:
        await box.start()
        try:
            res = await box.exec("ls /tests && touch /logs/verifier/x")
            return res.stdout.split(), res.return_code == 0
        finally:
            await box.stop()
    assert run(listing()) == (["expected.txt", "test.sh"], True)


def test_a_verifier_image_that_does_not_build_is_unscored(backend, store, tmp_path: Path):
    d = copy(tmp_path, SEPARATE, **{"tests/Dockerfile": "FROM debian:bookworm-slim\nCOPY no-such-file /tests/\n"})
    res = evaluate(backend, store, OracleAgent(), d)[0]
    assert (res.reward, res.status) == (None, "infra_error") and "verifier" in res.error


def test_the_model_agent_gets_each_step_as_the_next_user_turn(backend, store):
    """One conversation, one trajectory, one reward: each later step's instruction follows the model's
    answer to the step before, as a user turn; nothing sampled is re-tokenized."""
    from test_agent import ScriptedPolicy
    from tests_support import agent_params

    from furlong.agent.episode import run_episode
    from furlong.engine.base import SamplingParams
    from furlong.envs.harbor import HarborEnv
    from furlong.model.chat import Message, ToolCall
    from furlong.model.loading import load_tokenizer
    from furlong.model.tiny import init_tiny
    from furlong.sandbox.pool import FreshSandboxes, StoreImages

    tokenizer = load_tokenizer(init_tiny())
    done = Message("assistant", "Done.")
    turns = [Message("assistant", "", (ToolCall("bash", {"command": command}),))
             for command in ("echo one > /app/notes.txt", "cat /app/extra.txt >> /app/notes.txt",
                             "cp /app/notes.txt /logs/artifacts/notes.txt")]
    policy = ScriptedPolicy(tokenizer, [turns[0], done, turns[1], done, turns[2], done])
    env = HarborEnv(FreshSandboxes(backend, StoreImages(store, backend)), layers=store)
    ep = run(run_episode(load_task(STEPS), policy, tokenizer, env, agent_params(max_turns=10, max_context_tokens=4096),
                         SamplingParams()))
    assert (ep.status, ep.reward, ep.turns) == ("ok", 1.0, 6)
    assert [(s.name, s.reward) for s in ep.steps] == [("create", 1.0), ("extend", 1.0), ("publish", 1.0)]
    for before, after, sampled in zip(policy.prompts, policy.prompts[1:], policy.turns):
        assert after[: len(before) + len(sampled)] == before + sampled
    after_answer = policy.prompts[2][len(policy.prompts[1]) + len(policy.turns[1]):]
    assert "Append the line in /app/extra.txt" in tokenizer.decode(after_answer)
    assert "Append the line" not in tokenizer.decode(policy.prompts[1])  # not shown before its step
    assert sum(ep.loss_mask) == sum(len(t) for t in policy.turns)


def test_an_openenv_client_is_told_each_next_step(backend, store):
    """`furlong openenv serve`: `done` ends a step, and the observation holds the next step's instruction;
    the last step's `done` brings the episode's reward."""
    from openenv.core.generic_client import GenericEnvClient
    from openenv_support import HEADERS, ThreadServer

    from furlong.sandbox.pool import FreshSandboxes

    task = load_task(STEPS)
    server = ThreadServer([task], FreshSandboxes(backend, StoreImages(store, backend)))
    commands = ["echo one > /app/notes.txt", "cat /app/extra.txt >> /app/notes.txt",
                "cp /app/notes.txt /logs/artifacts/notes.txt"]

    async def episode() -> list[tuple[str, bool, float | None]]:
        async with GenericEnvClient(base_url=server.url, headers=HEADERS, message_timeout_s=120) as env:
            seen = [((await env.reset(task_id=task.id)).observation["instruction"], False, None)]
            for command in commands:
                await env.step({"command": command})
                step = await env.step({"done": True})
                seen.append((step.observation.get("instruction", ""), step.done, step.reward))
            return seen
    try:
        seen = run(episode())
    finally:
        server.stop()
    instructions = [s.instruction for s in task.steps]
    assert seen == [(instructions[0], False, None), (instructions[1], False, None), (instructions[2], False, None),
                    ("", True, 1.0)]


def test_a_step_that_cannot_be_set_up(backend, store, tmp_path: Path):
    """The agent of step one leaves step two's setup.sh unable to run: that step counts 0 and ends the
    episode (harbor would leave it out of the mean: breaking the next step would raise the reward). A
    setup.sh that fails before any agent ran is the task's: unscored."""
    breaker = Commands("echo one > /app/notes.txt; mkdir /app/extra.txt")
    res = evaluate(backend, store, breaker, STEPS)[0]
    assert [(s.name, s.reward) for s in res.steps] == [("create", 1.0), ("extend", 0.0)]
    assert (res.reward, res.status) == (0.5, "ok") and "setup.sh exited" in res.steps[1].error
    d = copy(tmp_path, STEPS)
    (d / "steps" / "create" / "workdir").mkdir()
    (d / "steps" / "create" / "workdir" / "setup.sh").write_text("exit 3\n")
    res = evaluate(backend, store, OracleAgent(), d)[0]
    assert (res.reward, res.status) == (None, "infra_error") and "setup.sh exited 3" in res.error


def test_a_step_whose_tests_hang_counts_zero_and_ends_the_episode(backend, store, tmp_path: Path):
    toml = (STEPS / "task.toml").read_text().replace('min_reward = 1.0\n', 'min_reward = 1.0\n[steps.verifier]\n'
                                                     'timeout_sec = 1.0\n')
    d = copy(tmp_path, STEPS, **{"task.toml": toml, "steps/create/tests/test.sh": "echo 1 > /logs/verifier/reward.txt; "
                                 "sleep 60\n"})
    res = evaluate(backend, store, OracleAgent(), d)[0]
    assert [(s.name, s.reward) for s in res.steps] == [("create", 0.0)]
    assert (res.reward, res.status) == (0.0, "timeout") and "timed out" in res.steps[0].error


def test_reward_functions_score_the_last_step_in_its_verifiers_sandbox(backend, store):
    """A reward command runs after the last step's tests, where they ran: the separate verifier's sandbox,
    which holds the published notes (two lines) and not the agent's /app/notes.txt."""
    from furlong.envs.harbor import HarborEnv
    from furlong.envs.rewards import RewardFn, Scorer
    from furlong.sandbox.pool import FreshSandboxes

    lines = RewardFn("lines", command="test ! -e /app/notes.txt && wc -l < /logs/artifacts/notes.txt")
    env = HarborEnv(FreshSandboxes(backend, StoreImages(store, backend)), scorer=Scorer([lines]), layers=store)
    res = run(run_eval([load_task(STEPS)], OracleAgent(), backend, store, 1, None, Console(quiet=True), env=env))[0]
    assert (res.reward, res.status, res.rewards) == (3.0, "ok", {"tests": 1.0, "lines": 2.0})


def test_an_artifact_among_the_tests_toolchain_is_tampering(backend, store, tmp_path: Path):
    """A task that hands /usr/local/bin/bash over as an artifact: the agent's fake `bash` (which writes
    reward 1) lands first on the tests' PATH in the verifier's sandbox. The artifacts are the agent's
    there, so the rule of what the verifier trusts applies to them: scored 0 as reward_tampered."""
    toml = (SEPARATE / "task.toml").read_text().replace('artifacts = ["/app/answer.txt"]',
                                                      'artifacts = ["/app/answer.txt", "/usr/local/bin/bash"]')
    d = copy(tmp_path, SEPARATE, **{"task.toml": toml})
    fake = ("printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /usr/local/bin/bash && "
            "chmod +x /usr/local/bin/bash")
    res = evaluate(backend, store, Commands(fake), d)[0]
    assert (res.reward, res.status) == (0.0, "reward_tampered") and "/usr/local/bin/bash" in res.tampered_paths
