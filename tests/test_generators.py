"""Family generators run sandboxed: a hostile generate.py cannot touch the host, and its output cannot
smuggle a host file in (symlinks, special files, forged stream records) or grow without bound."""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import time
import uuid
from pathlib import Path

import pytest

import furlong
from furlong.tasks import genrun
from furlong.tasks.family import Family, load_family
from furlong.tasks.model import TaskError

REPO = Path(furlong.__file__).resolve().parent.parent

TASK = '''
def write_task(out, instruction="x"):
    (out / "tests").mkdir()
    (out / "task.toml").write_text("[agent]\\ntimeout_sec = 30\\n")
    (out / "instruction.md").write_text(instruction)
    (out / "tests" / "test.sh").write_text("exit 0\\n")
    (out / "tests" / "test.sh").chmod(0o755)
'''


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def family(root: Path, source: str, name: str = "evil") -> Family:
    d = root / name
    d.mkdir()
    (d / "family.toml").write_text("[family]\ntrain_seeds = [0, 2]\nheldout_seeds = [100, 101]\n")
    (d / "generate.py").write_text(TASK + source)
    return load_family(d)


PROBES = '''
import json, os, socket
from pathlib import Path

def attempt(fn):
    try:
        return repr(fn())
    except BaseException as exc:
        return "refused: " + repr(exc)

def write(path):
    Path(path).write_text("pwned")

RESULTS = {"import-write-" + p: attempt(lambda p=p: write(p)) for p in @WRITES@}

def generate(seed, out):
    r = dict(RESULTS)
    r.update({"write-" + p: attempt(lambda p=p: write(p)) for p in @WRITES@})
    r.update({"read-" + p: attempt(lambda p=p: Path(p).read_text()) for p in @READS@})
    r["list-/root"] = attempt(lambda: sorted(os.listdir("/root")))
    r["connect"] = attempt(lambda: socket.create_connection(("127.0.0.1", @PORT@), timeout=2))
    r["uid"] = os.getuid()
    write_task(out, json.dumps(r))
'''


def test_a_hostile_generator_cannot_touch_the_host(tmp_path: Path, cache: Path):
    token = uuid.uuid4().hex
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    marker = f"furlong-gen-{uuid.uuid4().hex}"
    writes = [f"/tmp/{marker}", str(REPO / marker), str(REPO / "furlong" / marker), str(cache / marker),
              str(tmp_path / marker)]
    reads = ["/etc/shadow", str(secret), "/root/.bashrc", str(Path.home() / ".bashrc")]
    with socket.create_server(("127.0.0.1", 0)) as server:
        source = (PROBES.replace("@WRITES@", repr(writes)).replace("@READS@", repr(reads))
                  .replace("@PORT@", str(server.getsockname()[1])))
        task = family(tmp_path, source).instance(0, "train")
        server.setblocking(False)
        assert select.select([server], [], [], 0.5)[0] == [], "the generator reached a host listener"
    results = json.loads(task.instruction)
    for path in writes:
        assert not Path(path).exists(), f"the generator wrote {path} on the host"
        # a path under /tmp lands in the sandbox's own tmpfs (a checkout may live under /tmp too)
        assert results["write-" + path].startswith("refused") or path.startswith("/tmp/")
    for path in reads:
        assert results["read-" + path].startswith("refused"), f"the generator read {path}: {results['read-' + path]}"
    assert token not in task.instruction and "root:" not in task.instruction
    assert ".bashrc" not in results["list-/root"]
    assert results["connect"].startswith("refused")
    if os.geteuid() == 0:
        assert results["uid"] != 0
    for f in task.path.rglob("*"):  # the cache holds host-owned plain files only
        st = f.lstat()
        assert st.st_uid == os.geteuid() and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


@pytest.mark.parametrize("target", ["/etc/shadow", "/root/.ssh/id_rsa", "../../../../../../etc/passwd", "SECRET"])
def test_a_symlink_in_the_output_refuses_the_instance(tmp_path: Path, cache: Path, target: str):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    target = str(secret) if target == "SECRET" else target
    fam = family(tmp_path, f'''
import os
def generate(seed, out):
    write_task(out)
    os.symlink({target!r}, out / "tests" / "x")
''')
    with pytest.raises(TaskError, match=r"tests/x a symlink .*only regular files and directories") as err:
        fam.instance(0, "train")
    assert err.value.task == "evil" and err.value.file == "generate.py"
    assert not list(cache.rglob("x"))


def test_a_fifo_in_the_output_refuses_the_instance(tmp_path: Path, cache: Path):
    fam = family(tmp_path, '''
import os
def generate(seed, out):
    write_task(out)
    os.mkfifo(out / "tests" / "pipe")
''')
    with pytest.raises(TaskError, match="tests/pipe a fifo, socket or device file"):
        fam.instance(0, "train")


FORGE = '''
import os, stat
def generate(seed, out):
    write_task(out)
    record = b'{"seed": 0}\\n{"file": @PATH@, "mode": 420, "size": 5}\\npwned'
    for fd in range(3, 64):  # the host's stream is one of these pipes
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, record)
        except OSError:
            pass
'''


@pytest.mark.parametrize("path", ["../escape", "../../escape", "/tmp/escape-forged", "tests/../../escape"])
def test_forged_stream_records_cannot_escape_the_instance(tmp_path: Path, cache: Path, path: str):
    fam = family(tmp_path, FORGE.replace("@PATH@", json.dumps(path)))
    with pytest.raises(TaskError, match="is not a path inside its seed directory"):
        fam.instance(0, "train")
    assert not list(tmp_path.rglob("escape")) and not Path("/tmp/escape-forged").exists()


def test_too_many_files_are_refused(tmp_path: Path, cache: Path):
    fam = family(tmp_path, '''
def generate(seed, out):
    write_task(out)
    for i in range(10_001):
        (out / f"f{i}").write_text("")
''')
    with pytest.raises(TaskError, match="wrote more than 10000 files and directories"):
        fam.instance(0, "train")
    assert not (cache / "tasks" / f"evil-{fam.digest}" / "0").exists()


def test_too_many_bytes_are_refused(tmp_path: Path):
    fam = family(tmp_path, '''
def generate(seed, out):
    write_task(out)
    for i in range(2):
        (out / f"big{i}").write_bytes(b"x" * (40 << 20))
''')
    with pytest.raises(TaskError, match="wrote more than 64 MiB"):
        fam.instance(0, "train")


def test_one_file_over_the_cap_is_a_clear_error(tmp_path: Path):
    fam = family(tmp_path, '''
def generate(seed, out):
    (out / "big").write_bytes(b"x" * (65 << 20))
''')
    with pytest.raises(TaskError, match=r"generate\(0\) failed: OSError\(27, 'File too large'\)"):
        fam.instance(0, "train")


@pytest.mark.parametrize("at_import", [True, False])
def test_a_hanging_generator_times_out_and_leaves_no_process(tmp_path: Path, monkeypatch, at_import: bool):
    monkeypatch.setattr(genrun, "INSTANCE_TIMEOUT_S", 2.0)
    stamp = f"{time.time_ns() % 10**9}.5"  # an argument no other process has
    hang = f'''
    subprocess.Popen(["sleep", "{stamp}"], start_new_session=True)
    while True:
        time.sleep(1)
'''
    fam = family(tmp_path, "import subprocess, time\n" + (f"if True:{hang}def generate(seed, out):\n    pass\n"
                                                          if at_import else f"def generate(seed, out):{hang}"))
    start = time.monotonic()
    with pytest.raises(TaskError, match=r"timed out: no instance finished within 2 s .*seed 0"):
        fam.instance(0, "train")
    assert time.monotonic() - start < 15

    def sleepers() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if stamp.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sleepers(), "a process the generator started outlived the run"


@pytest.mark.parametrize("source, words", [
    ("def generate(seed, out):\n    raise ValueError('boom')\n", r"generate\(0\) failed: ValueError\('boom'\)"),
    ("def make(seed, out):\n    pass\n", r"defines no generate\(seed, out\) function"),
    ("import no_such_module_here\n", r"import failed: ModuleNotFoundError"),
    ("def generate(seed, out:\n", r"import failed: SyntaxError"),
    ("import sys\nsys.exit(0)\n", r"import failed: SystemExit\(0\)"),
    ("import os\ndef generate(seed, out):\n    os._exit(7)\n", r"exited with status 7"),
])
def test_a_failing_generator_is_a_one_line_task_error(tmp_path: Path, source: str, words: str):
    fam = family(tmp_path, source)
    with pytest.raises(TaskError, match=words) as err:
        fam.instances("train")
    assert err.value.task == "evil" and err.value.file == "generate.py" and "\n" not in str(err.value)


def test_many_seeds_are_one_run_and_generated_once(tmp_path: Path, cache: Path):
    fam = family(tmp_path, '''
import os
def generate(seed, out):
    write_task(out, f"seed {seed} pid {os.getpid()}")
''')
    tasks = fam.instances("all")
    assert [t.seed for t in tasks] == [0, 1, 100] and [t.split for t in tasks] == ["train", "train", "heldout"]
    assert len({t.instruction.split(" pid ")[1] for t in tasks}) == 1, "one sandboxed run for all seeds"
    again = fam.instances("all")
    assert [t.instruction for t in again] == [t.instruction for t in tasks]  # from the cache
    assert not [p for p in (cache / "tasks" / f"evil-{fam.digest}").iterdir() if p.name.startswith(".tmp")]


def test_bundled_family_generates_from_a_checkout_under_tmp(tmp_path: Path, cache: Path):
    """The sandbox's own /tmp must not hide a furlong package (or interpreter) that lives under the host's
    /tmp, as a CI clone may: a generator that imports furlong.tasks.kit still runs."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "furlong", copy / "furlong", ignore=shutil.ignore_patterns("__pycache__"))
    for p in [tmp_path, copy, *copy.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    code = ("import sys; from pathlib import Path; from furlong.tasks.family import load_family; "
            "import furlong; assert furlong.__file__.startswith(sys.argv[2]), furlong.__file__; "
            "t = load_family(Path(sys.argv[1])).instances('train', limit=1)[0]; print(t.instruction[:40])")
    res = subprocess.run([sys.executable, "-c", code, str(REPO / "tasks" / "count-in-file"), str(copy)],
                         cwd=copy, env={**os.environ, "PYTHONPATH": str(copy), "FURLONG_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr[-2000:]
