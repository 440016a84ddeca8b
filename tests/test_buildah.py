"""Full Dockerfiles through the real buildah: multi-stage, ARG, LABEL, USER, COPY --from, heredocs and a
stand-in base, unpacked into the store and run in a real sandbox; the cache; errors naming file:line;
routing (the subset stays native). Heredoc conversion is also checked on its own, with /bin/sh."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import skips
from conftest import run, spec

from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.images import heredoc
from furlong.sandbox.images.buildah import Buildah
from furlong.sandbox.images.store import ImageBuildError, ImageStore

FULL = """\
ARG BASE=furlong/base
FROM ${BASE} AS builder
ARG GREETING=hello
RUN echo "$GREETING from the builder" > /greeting
RUN <<EOF
echo plain heredoc > /plain.txt
EOF

FROM python:3.11-slim AS final
ARG LEVEL=3
RUN echo "level $LEVEL" > /level-first.txt
ARG LEVEL=4
LABEL org.example.task="buildah test"
ENV APP_MODE=test
WORKDIR /app
COPY --from=builder /greeting /plain.txt ./
COPY data.txt ./
RUN <<-EOF
\techo "dashed $LEVEL" > /app/dashed.txt
\tEOF
RUN cat <<'EOF' > /app/quoted.txt
literal $HOME
EOF
RUN python3 - <<EOF
open("/app/py.txt", "w").write(str(6 * 7))
EOF
RUN <<EOF
#!/usr/bin/env python3
open("/app/shebang.txt", "w").write("from python")
EOF
RUN useradd -m runner && pip --version > /app/pip.txt
USER runner
"""


def _task(tmp_path: Path, text: str, files: dict[str, str] | None = None) -> Path:
    env = tmp_path / "task" / "environment"
    env.mkdir(parents=True, exist_ok=True)
    for name, content in (files or {}).items():
        (env / name).write_text(content)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


def _sh(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)


def test_heredoc_runs_become_one_line_runs_that_keep_line_numbers(tmp_path: Path):
    out = tmp_path / "out"
    text = (f"FROM x\nRUN <<EOF\necho plain > {out}.1\nEOF\nRUN <<-EOF\n\techo dashed > {out}.2\n\tEOF\n"
            f"RUN cat <<'EOF' > {out}.3\nliteral $HOME\nEOF\nRUN cat <<A > {out}.4 && cat <<-B > {out}.5\n$HOME\nA\n"
            f"\tbee\n\tB\nRUN <<EOF\n#!/usr/bin/env python3\nopen('{out}.6', 'w').write('py')\nEOF\nENV X=1\n")
    converted = heredoc.convert(tmp_path / "Dockerfile", text).splitlines()
    assert len(converted) == len(text.splitlines()) and converted[-1] == "ENV X=1"
    runs = [line for line in converted if line.startswith("RUN ")]
    assert len(runs) == 5 and all("<<" not in run_ for run_ in runs)
    for run_ in runs:
        assert _sh(run_[4:]).returncode == 0
    got = [Path(f"{out}.{n}").read_text() for n in range(1, 7)]
    assert got == ["plain\n", "dashed\n", "literal $HOME\n", f"{Path.home()}\n", "bee\n", "py"]


@pytest.mark.parametrize("text, line, words", [
    ("FROM x\nRUN <<EOF\necho never closed\n", 2, "never closed"),
    ("FROM x\nCOPY <<EOF /etc/x\nbody\nEOF\n", 2, "COPY <<EOF (an inline file) is not supported"),
])
def test_unsupported_heredocs_name_the_line(tmp_path: Path, text: str, line: int, words: str):
    with pytest.raises(df.DockerfileError) as err:
        heredoc.convert(tmp_path / "Dockerfile", text)
    assert err.value.line == line and words in str(err.value)


@pytest.mark.parametrize("text, reason", [
    ("FROM debian:bookworm\nRUN true\nENV A=1\nWORKDIR /a\nCOPY x /x\n", None),
    ("FROM debian:bookworm\nLABEL a=b\n", ":2: LABEL"),
    ("ARG V=1\nFROM debian:bookworm\n", ":1: ARG"),
    ("FROM debian:bookworm AS b\nRUN true\n", ":1: FROM debian:bookworm AS b"),
    ("FROM debian:bookworm\nFROM debian:bookworm\n", ":2: a second FROM"),
    ("FROM debian:bookworm\nCOPY --from=b /a /a\n", ":2: COPY --from=b"),
    ("FROM debian:bookworm\nRUN <<EOF\ntrue\nEOF\n", ":2: a heredoc"),
    ("FROM debian:bookworm\nRUN echo $((1<<2))\n", None),
])
def test_routing_names_the_first_thing_outside_the_subset(tmp_path: Path, text: str, reason: str | None):
    why = df.outside_subset(_task(tmp_path, text))
    assert why is None if reason is None else (why.startswith(str(tmp_path)) and reason in why)


def test_full_dockerfile_builds_with_buildah_and_runs_in_a_sandbox(store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, FULL, {"data.txt": "context data\n"})
    log: list[str] = []
    ref = run(store.image(path, backend, log.append))
    meta = json.loads((store.root / ref.digest / "meta.json").read_text())
    assert meta["builder"] == "buildah" and meta["labels"]["org.example.task"] == "buildah test"
    assert len(ref.layers) == 3 and ref.workdir == "/app" and ("APP_MODE", "test") in ref.env  # over the stand-in
    assert ref.user == "runner" and "python stand-in" in ref.note
    assert any("built by buildah" in line for line in log)

    async def check():
        box = await backend.create(spec(ref))
        try:
            script = ("pwd; echo $APP_MODE $LANG; cat greeting plain.txt data.txt /level-first.txt dashed.txt "
                      "quoted.txt py.txt shebang.txt; echo; id -un; head -c 4 pip.txt; echo; "
                      "test -e /usr/lib/python3.11/EXTERNALLY-MANAGED && echo marker || echo no-marker")
            return await box.exec(script, cwd=ref.workdir, env=dict(ref.env))
        finally:
            await box.close()

    res = run(check())
    assert res.ok, res.stderr
    assert res.stdout.splitlines() == [
        "/app", "test C.UTF-8", "hello from the builder", "plain heredoc", "context data", "level 3", "dashed 4",
        "literal $HOME", "42from python", "runner", "pip ", "no-marker"]  # USER runner; the stand-in's whiteout holds


def test_second_build_is_a_cache_hit(store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, FULL, {"data.txt": "context data\n"})
    first = run(store.image(path, backend))
    meta = store.root / first.digest / "meta.json"
    written = meta.stat().st_mtime_ns
    started = time.monotonic()
    again = run(ImageStore(root=store.root).image(path, backend))  # a new store: no in-memory answer
    assert again.digest == first.digest and meta.stat().st_mtime_ns == written
    assert time.monotonic() - started < 10
    (path.parent / "data.txt").write_text("changed\n")  # the context's content is part of the key
    changed_key = run(ImageStore(root=store.root).image(path, backend)).digest
    assert changed_key != first.digest


def test_failing_run_names_the_users_file_and_line(store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, "FROM furlong/base AS one\nRUN true\n\nFROM furlong/base\nLABEL x=y\n"
                           "RUN echo marker-output && \\\n    exit 3\nRUN true\n")
    with pytest.raises(ImageBuildError) as err:
        run(store.image(path, backend))
    first = str(err.value).splitlines()[0]
    assert first == f"{path}:6: RUN exited 3:" and "marker-output" in str(err.value)
    leftovers = Buildah(store.root.parent / "buildah").run("containers", "--quiet")
    assert leftovers.strip() == ""  # the failed build's working containers (and their mounts) are gone


def test_unknown_base_in_a_stage_names_the_line(store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, "FROM furlong/base AS one\nRUN true\nFROM Not_A/Valid::Reference\nLABEL a=b\n")
    with pytest.raises(ImageBuildError) as err:
        run(store.image(path, backend))
    assert str(err.value).startswith(f"{path}:3: FROM ") and "\n" not in str(err.value)


def test_a_simple_dockerfile_still_takes_the_native_path(store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, "FROM furlong/base\nENV A=1\nRUN echo native > /n.txt\n")
    ref = run(store.image(path, backend))
    meta = json.loads((store.root / ref.digest / "meta.json").read_text())
    assert meta["builder"] == "furlong" and ref.digest.startswith("layer-") and len(ref.layers) == 2


@skips.needs_root("a user's rootless buildah keeps the user's own network (documented)")
def test_build_steps_cannot_reach_host_loopback_but_resolve_names(tmp_path: Path, store: ImageStore, backend):
    """As root, buildah's RUN steps (chroot isolation) would share the host's network namespace; they run
    in a fenced pasta namespace instead, like furlong's own networked build sandboxes."""
    accepted = []
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    port = server.getsockname()[1]
    probe = ("import re, socket\n"
             "s = socket.socket(); s.settimeout(3)\n"
             f"out = ['loopback %d' % s.connect_ex(('127.0.0.1', {port}))]\n"
             "host = re.search(r'^deb \\w+://([^/ ]+)', open('/etc/apt/sources.list').read(), re.M).group(1)\n"
             "try:\n    socket.getaddrinfo(host, 80); out.append('resolved')\n"
             "except OSError:\n    out.append('unresolved')\n"
             "open('/probe.txt', 'w').write(' '.join(out))\n")
    text = "FROM furlong/base\nLABEL probe=network\nCOPY probe.py /probe.py\nRUN python3 /probe.py\n"
    dockerfile = _task(tmp_path, text, {"probe.py": probe})
    image = run(store.image(dockerfile, backend))

    async def go():
        box = await backend.create(spec(image))
        try:
            return (await box.exec("cat /probe.txt")).stdout
        finally:
            await box.close()

    out = run(go())
    server.close()
    assert accepted == [] and out.startswith("loopback ") and "loopback 0" not in out, out
    assert out.split()[-1] == "resolved", out  # DNS through pasta's forwarder


def _tiny_rootfs(root: Path) -> Path:
    """/bin/sh and /bin/sleep with their libraries, copied from the host: enough for a RUN step."""
    rootfs = root / "rootfs"
    for binary in ("/bin/sh", "/bin/sleep"):
        libs = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", binary], capture_output=True, text=True).stdout)
        for path in (binary, *libs):
            (rootfs / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, rootfs / path.lstrip("/"))
    return rootfs


@skips.needs_root("as a user, buildah mounts in a user namespace of its own anyway")
def test_a_build_killed_mid_run_leaves_no_mount_on_the_host(tmp_path: Path):
    """Root's buildah mounts its containers' layers; a build killed at its timeout never unmounts them, and
    every mount left in the host's table slows every later sandbox start. Its own mount namespace takes them."""
    home = Path(tempfile.mkdtemp(prefix="test-buildah-mounts-", dir="/var/cache"))  # overlay needs a real fs
    bh = Buildah(home)
    try:
        ctr = bh.run("from", "scratch").strip()
        bh.run("copy", ctr, str(_tiny_rootfs(tmp_path)), "/")
        bh.run("commit", "--quiet", ctr, "localhost/tiny")
        bh.run("rm", ctr)
        (tmp_path / "Dockerfile").write_text("FROM localhost/tiny\nRUN sleep 15\n")
        mine = lambda: [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(home) in ln]
        status, _ = bh.bud(tmp_path / "Dockerfile", tmp_path, "localhost/killed", lambda _: None, timeout_s=4)
        assert status == -9  # killed in its RUN step, the working container still mounted where buildah ran
        assert mine() == []
        assert len(json.loads(bh.run("containers", "--json"))) == 1  # the proof that it died mid-build
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_final_stage_ending_in_workdir_makes_its_directory(store: ImageStore, backend, tmp_path: Path):
    """Docker's WORKDIR creates its directory; buildah only does when a later RUN uses it. Through a
    symlink the image's own tree is followed (/work -> /srv), never the host's."""
    stages = "FROM furlong/base AS build\nRUN echo built > /out.txt\n\nFROM furlong/base\nCOPY --from=build /out.txt /out.txt\n"
    plain = run(store.image(_task(tmp_path / "plain", stages + "WORKDIR /app\n"), backend))
    linked = run(store.image(_task(tmp_path / "linked", stages + "RUN ln -s /srv /work\nWORKDIR /work/sub\n"), backend))
    # the base's own /lib -> usr/lib: followed through the layer below
    based = run(store.image(_task(tmp_path / "based", stages + "WORKDIR /lib/app\n"), backend))
    assert json.loads((store.root / plain.digest / "meta.json").read_text())["builder"] == "buildah"
    assert (plain.workdir, linked.workdir, based.workdir) == ("/app", "/work/sub", "/lib/app")
    assert os.path.islink(store.root / based.layers[0].path / "lib")  # brought up from the base, not covered

    async def go(ref):
        box = await backend.create(spec(ref))
        try:
            return await box.exec("pwd -P; cat /out.txt; stat -c '%U %a' .", cwd=ref.workdir)
        finally:
            await box.close()

    for ref, where in ((plain, "/app"), (linked, "/srv/sub"), (based, "/usr/lib/app")):
        res = run(go(ref))
        assert res.ok, res.stderr
        assert res.stdout.splitlines() == [where, "built", "root 755"]


def test_a_native_build_ending_in_workdir_makes_its_directory(store: ImageStore, backend, tmp_path: Path):
    ref = run(store.image(_task(tmp_path, "FROM furlong/base\nRUN true\nWORKDIR /app/deep\n"), backend))
    assert json.loads((store.root / ref.digest / "meta.json").read_text())["builder"] == "furlong"

    async def go():
        box = await backend.create(spec(ref))
        try:
            return await box.exec("pwd", cwd=ref.workdir)
        finally:
            await box.close()

    assert run(go()).stdout.strip() == "/app/deep"


LAYERED = """\
FROM python:3.11-slim AS build
RUN echo built > /built.txt && rm /etc/debian_version && ln /built.txt /built-link.txt

FROM build
COPY --from=build /built.txt /opt/copied.txt
RUN chmod 700 /etc/issue && useradd --uid 1234 keeper && chown keeper:keeper /etc/motd && \\
    echo changed > /etc/issue.net && ln -s /opt/copied.txt /etc/to-copied && rm -rf /usr/share/doc/bash && \\
    ln /etc/issue.net /etc/issue.net-link
WORKDIR /srv/app
"""


def _du(*dirs: Path) -> int:
    """Bytes on disk under `dirs`, each inode once (GNU du counts a hard link once across its arguments)."""
    # no check: as a user, du still totals what it can read, and says what it could not on stderr
    out = subprocess.run(["du", "-s", "-B1", "--total", *map(str, dirs)], capture_output=True, text=True)
    return int(out.stdout.splitlines()[-1].split()[0])


def _tree(layers: list[Path]) -> dict[str, tuple]:
    """What an overlay of `layers` shows: each path's type, mode, owner and content (or target)."""
    from furlong.sandbox.images.flatten import merged

    out = {}
    for rel, path, st in merged(layers):
        what = os.readlink(path) if os.path.islink(path) else (
            hashlib.sha256(Path(path).read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else "")
        out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode) if not os.path.islink(path) else 0,
                    st.st_uid, st.st_gid, what)
    return out


def test_a_buildah_image_stores_only_the_layer_above_its_base(store: ImageStore, backend, tmp_path: Path):
    """The final stage (a chain: FROM build, itself FROM python:3.11-slim) is stored as one small layer
    over the stand-in's layers; the image's tree is exactly the one a whole export of it gives."""
    ref = run(store.image(_task(tmp_path, LAYERED), backend))
    parent = run(store.parent("python:3.11-slim", backend, lambda _: None))
    meta = json.loads((store.root / ref.digest / "meta.json").read_text())
    assert ref.layers[1:] == parent.layers and meta["stored"].startswith(f"above {parent.digest}: ")
    upper = store.root / ref.layers[0].path
    below = [store.root / layer.path for layer in parent.layers]
    assert _du(upper) < min(_du(*below) // 20, 4 << 20), (_du(upper), _du(*below))
    gone = os.lstat(upper / "etc/debian_version")  # a deletion: an overlay whiteout, as native layers hold
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert not (upper / "usr/bin").exists()  # nothing the base has as it is

    whole = tmp_path / "whole"  # the same image exported whole, as every buildah image was stored before
    whole.mkdir()
    Buildah(store.root.parent / "buildah").export(f"localhost/furlong/{ref.digest}", whole, "whole", store.egress,
                                                  workdir=ref.workdir)
    assert _tree([upper, *below]) == _tree([whole])

    async def check():
        box = await backend.create(spec(ref))
        try:
            return await box.exec("pwd; cat /built.txt /opt/copied.txt /etc/issue.net; readlink /etc/to-copied; "
                                  "test -e /etc/debian_version || echo deleted; test -e /usr/share/doc/bash || "
                                  "echo doc-deleted; stat -c '%a %u %U' /etc/issue /etc/motd; "
                                  "stat -c %h /built-link.txt /etc/issue.net-link; python3 -c 'print(6*7)'",
                                  cwd=ref.workdir)
        finally:
            await box.close()

    res = run(check())
    assert res.ok, res.stderr
    owner = ["1234 keeper"] if os.geteuid() == 0 else ["0 root"]  # as a user every file is root's
    assert res.stdout.splitlines() == ["/srv/app", "built", "built", "changed", "/opt/copied.txt", "deleted",
                                       "doc-deleted", "700 0 root", f"644 {owner[0]}", "2", "2", "42"]


def test_a_final_stage_from_scratch_is_stored_whole(store: ImageStore, backend, tmp_path: Path):
    text = "FROM furlong/base AS root\nRUN echo made > /made.txt\n\nFROM scratch\nCOPY --from=root / /\n"
    ref = run(store.image(_task(tmp_path, text), backend))
    meta = json.loads((store.root / ref.digest / "meta.json").read_text())
    assert len(ref.layers) == 1 and meta["below"] == [] and "FROM scratch" in meta["stored"]

    async def check():
        box = await backend.create(spec(ref))
        try:
            return await box.exec("cat /made.txt; python3 -c 'print(6*7)'")
        finally:
            await box.close()

    assert run(check()).stdout.split() == ["made", "42"]
