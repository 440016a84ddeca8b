"""Task loading: Harbor and Terminal-Bench 1.0 directories, families, and errors that name the problem."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from furlong.sandbox.base import Prebuilt
from furlong.tasks.family import load_family
from furlong.tasks.loader import load_task
from furlong.tasks.model import TaskError
from furlong.tasks.suite import load_tasks

TOML = """\
version = "1.0"
[metadata]
difficulty = "easy"
unknown_key = "ignored, as Harbor ignores it"
[agent]
timeout_sec = 45.0
[verifier]
timeout_sec = 20
env = { MODE = "strict" }
[environment]
cpus = 0.5
memory_mb = 512
allow_internet = true
"""


def harbor(root: Path, name: str = "demo", toml: str = TOML, tests: bool = True) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "environment").mkdir()
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("Write hello to /app/out.txt\n")
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (d / "solution" / "solve.sh").write_text("echo hello > /app/out.txt\n")
    if tests:
        (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return d


def test_harbor_task_loads_every_field(tmp_path: Path):
    task = load_task(harbor(tmp_path))
    assert task.id == "demo" and task.instruction.startswith("Write hello")
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (45.0, 20.0)
    assert task.limits.cpus == 0.5 and task.limits.memory_mb == 512 and task.online
    assert task.verifier_env == (("MODE", "strict"),)
    assert task.test_script.name == "test.sh" and task.solution.name == "solve.sh"
    assert task.dockerfile.name == "Dockerfile" and task.format == "harbor"


def test_terminal_bench_task_loads(tmp_path: Path):
    d = tmp_path / "tb-task"
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text("instruction: |\n  Do the thing.\nmax_agent_timeout_sec: 90\nmax_test_timeout_sec: 15\n")
    (d / "run-tests.sh").write_text("exit 0\n")
    (d / "solution.sh").write_text("true\n")
    (d / "Dockerfile").write_text("FROM debian:bookworm\n")
    task = load_task(d)
    assert task.format == "terminal-bench" and task.instruction == "Do the thing.\n"
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (90.0, 15.0)
    assert task.test_script.name == "run-tests.sh" and task.solution.name == "solution.sh"


@pytest.mark.parametrize("toml, words", [
    ("[agent\ntimeout_sec = 1", "invalid TOML"),
    ("[agent]\ntimeout_sec = 'soon'", "field 'agent.timeout_sec'"),
    ("[agent]\ntimeout_sec = -5", "field 'agent.timeout_sec'"),
    ("[environment]\nmemory_mb = 'lots'", "field 'environment.memory_mb'"),
    ("[agent]\ntimeout_secs = 30", "unknown key 'agent.timeout_secs' (known here: timeout_sec"),
    ("[environment]\nmemory = '512M'\nmemroy_mb = 512", "unknown key 'environment.memroy_mb'"),
    ("[furlong]\nverifier_tool_chain = true", "unknown key 'furlong.verifier_tool_chain'"),
    ("timeout_sec = 30", "unknown key 'timeout_sec'"),
    ("[environment]\ndocker_image = 'Ubuntu:24.04'", ("field 'environment.docker_image': Value error, expected an "
                                                      "image reference")),
])
def test_malformed_task_toml_names_task_file_and_field(tmp_path: Path, toml: str, words: str):
    with pytest.raises(TaskError) as err:
        load_task(harbor(tmp_path, toml=toml))
    assert err.value.task == "demo" and err.value.file == "task.toml" and words in str(err.value)


def test_the_agent_user_is_the_agents_identity_and_one_for_every_step(tmp_path: Path):
    assert load_task(harbor(tmp_path / "a")).agent_user is None  # the image's USER
    assert load_task(harbor(tmp_path / "b", toml=TOML.replace("[agent]", "[agent]\nuser = 1000"))).agent_user == "1000"
    steps = TOML.replace("[agent]", "[agent]\nuser = 'app'") + "[[steps]]\nname = 'one'\n[steps.agent]\nuser = 'root'\n"
    d = harbor(tmp_path / "c", toml=steps)
    (d / "steps" / "one").mkdir(parents=True)
    (d / "steps" / "one" / "instruction.md").write_text("step one")
    with pytest.raises(TaskError, match="field 'steps.one.agent.user': 'root' differs from \\[agent\\] user 'app'"):
        load_task(d)


def test_harbor_keys_furlong_does_not_act_on_still_load(tmp_path: Path):
    toml = TOML.replace("[agent]", "anything = { nested = [1, 2] }\n[agent]") + textwrap.dedent("""
        build_timeout_sec = 600.0
        storage_mb = 10240
        gpus = 0
        docker_image = "ghcr.io/org/img:1"
        [solution]
        env = { A = "1" }
    """)
    task = load_task(harbor(tmp_path, toml="schema_version = '1.1'\nsource = 'tb2'\n" + toml))
    assert (task.agent_timeout_s, task.limits.memory_mb) == (45.0, 512)


def test_a_prebuilt_image_is_the_tasks_image_source_with_its_dockerfile(tmp_path: Path):
    """Harbor's docker_image names the image (its Dockerfile, if any, serves where no registry does:
    furlong.sandbox.images.prebuilt); without it the Dockerfile, without either the default base."""
    task = load_task(harbor(tmp_path, toml="[environment]\ndocker_image = 'ghcr.io/org/img:1'\n"))
    assert task.docker_image == "ghcr.io/org/img:1"
    assert task.image_source == Prebuilt("ghcr.io/org/img:1", task.dockerfile,
                                         "task 'demo': task.toml: environment.docker_image")
    plain = load_task(harbor(tmp_path, "plain", toml=""))
    assert plain.image_source == plain.dockerfile and plain.dockerfile is not None
    (plain.dockerfile).unlink()
    assert load_task(plain.path).image_source is None


def test_harbor_deprecated_memory_spelling_sets_the_limit(tmp_path: Path):
    assert load_task(harbor(tmp_path, toml="[environment]\nmemory = '4G'\n")).limits.memory_mb == 4096
    both = harbor(tmp_path, "both", "[environment]\nmemory = '4G'\nmemory_mb = 512\n")
    assert load_task(both).limits.memory_mb == 512
    with pytest.raises(TaskError, match="field 'environment.memory': Value error, expected a size like '4G'"):
        load_task(harbor(tmp_path, "bad", "[environment]\nmemory = 'lots'\n"))


def test_missing_tests_and_unreadable_files_are_named(tmp_path: Path):
    with pytest.raises(TaskError, match=r"'demo': tests/test.sh: missing"):
        load_task(harbor(tmp_path, tests=False))
    d = harbor(tmp_path, name="binary")
    (d / "instruction.md").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(TaskError, match=r"'binary': instruction.md: unreadable"):
        load_task(d)


@pytest.mark.parametrize("yaml_text, words", [
    ("instruction: [unclosed", "invalid YAML"),
    ("- a list", "expected a mapping"),
    ("max_agent_timeout_sec: 5", "field 'instruction'"),
    ("instruction: x\nmax_test_timeout_sec: never", "field 'max_test_timeout_sec'"),
])
def test_malformed_task_yaml_names_the_field(tmp_path: Path, yaml_text: str, words: str):
    d = tmp_path / "tb"
    d.mkdir()
    (d / "task.yaml").write_text(yaml_text)
    (d / "run-tests.sh").write_text("exit 0\n")
    with pytest.raises(TaskError) as err:
        load_task(d)
    assert err.value.file == "task.yaml" and words in str(err.value)


def _family(root: Path, toml: str | None = None) -> Path:
    d = root / "adder"
    d.mkdir()
    (d / "family.toml").write_text(toml or "[family]\ndescription = 'add'\ntrain_seeds = [0, 5]\nheldout_seeds = [100, 103]\n")
    (d / "generate.py").write_text(textwrap.dedent('''
        import random
        from pathlib import Path

        def generate(seed, out: Path):
            r = random.Random(seed)
            a, b = r.randint(1, 99), r.randint(1, 99)
            (out / "tests").mkdir()
            (out / "task.toml").write_text("[agent]\\ntimeout_sec = 30\\n")
            (out / "instruction.md").write_text(f"Write {a}+{b} to /app/sum.txt")
            (out / "tests" / "test.sh").write_text(f"test $(cat /app/sum.txt) = {a + b}")
    '''))
    return d


def test_family_instances_are_deterministic_and_split(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path / "cache"))
    fam = load_family(_family(tmp_path))
    train, heldout = fam.instances("train"), fam.instances("heldout")
    assert [t.seed for t in train] == [0, 1, 2, 3, 4] and [t.seed for t in heldout] == [100, 101, 102]
    assert {t.split for t in train} == {"train"} and train[0].id == "adder@0" and train[0].family == "adder"
    assert len({t.instruction for t in train}) > 1
    again = load_family(tmp_path / "adder").instance(0, "train")
    assert again.instruction == train[0].instruction
    assert len(load_tasks(tmp_path, split="all", per_family=2)) == 4


@pytest.mark.parametrize("toml, words", [
    ("[family]\ntrain_seeds = [0, 1000000000]\nheldout_seeds = [-10, 0]\n",
     "field 'family.train_seeds': 1000000000 seeds in [0, 1000000000]; at most 100000"),
    ("[family]\ntrain_seed = [0, 10]\nheldout_seeds = [10, 20]\n", "unknown key 'family.train_seed'"),
    ("[family]\ntrain_seeds = [0, 10]\nheldout_seeds = [10, 20]\n[generator]\nx = 1\n", "unknown key 'generator'"),
])
def test_bad_family_toml_names_the_key(tmp_path: Path, toml: str, words: str):
    _family(tmp_path, toml)
    with pytest.raises(TaskError) as err:
        load_family(tmp_path / "adder")
    assert err.value.file == "family.toml" and words in str(err.value)


def test_family_with_overlapping_splits_is_refused(tmp_path: Path):
    _family(tmp_path, "[family]\ntrain_seeds = [0, 10]\nheldout_seeds = [5, 20]\n")
    with pytest.raises(TaskError, match="overlap"):
        load_family(tmp_path / "adder")
