"""In the verifier phase, file ownership looks as Docker's root sees it (docs/sandboxes.md, "The verifier's own
identity"): the agent's uid 0 is 65533 in the verifier's namespace, and the ownership shim the init preloads
into verifier commands (furlong/sandbox/runtime/native/owner.c) shows it as root's. Real programs (git, ssh, sudo,
python) check what an agent left, in one sandbox of one image; the shim's path is attacked from the agent's
side. CI runs this file as root and again as an ordinary user.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from conftest import run, spec

from furlong.sandbox.runtime import idmap, native
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.bwrap_argv import OWNER_SHIM

DOCKERFILE = """FROM debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends git openssh-client sudo && rm -rf /var/lib/apt/lists/*
RUN printf '[%s]' "$LD_PRELOAD" > /preload-at-build
"""

# What an agent leaves, as root does in Docker: a repository, an ssh config, a private file, a database-like
# data directory, and a web server still running.
AGENT_SETUP = r"""set -e
mkdir -p /app/repo && cd /app/repo && git init -q -b main && echo hello > f && git add f
git -c user.name=agent -c user.email=agent@example.com commit -qm 'agent commit'
mkdir -p -m 700 /root/.ssh && printf 'Host somehost\n  User tester\n  Port 2222\n' > /root/.ssh/config
chmod 600 /root/.ssh/config
echo secret > /app/secret && chmod 600 /app/secret
mkdir -m 700 /app/data && echo 42 > /app/data/value
mkdir -p /app/www && echo served > /app/www/index.txt
setsid python3 -m http.server 8123 --bind 127.0.0.1 --directory /app/www > /dev/null 2>&1 < /dev/null &
for i in $(seq 300); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8123/')" 2>/dev/null && break; sleep 0.1; done
"""

# A server that checks its data directory as PostgreSQL does: it must be the server's own user's, mode 0700.
OWNER_CHECKING_SERVER = r"""import os, socket, stat, sys
data, port = sys.argv[1], int(sys.argv[2])
st = os.stat(data)
if st.st_uid != os.geteuid():
    sys.exit(f"FATAL: data directory {data} has wrong ownership: owned by {st.st_uid}, running as {os.geteuid()}")
if stat.S_IMODE(st.st_mode) & 0o077:
    sys.exit(f"FATAL: data directory {data} has group or world access")
server = socket.create_server(("127.0.0.1", port))
print("ready", flush=True)
conn, _ = server.accept()
conn.sendall(open(os.path.join(data, "value"), "rb").read())
"""
QUERY = "python3 -c 'import socket; print(socket.create_connection((\"127.0.0.1\", 8124)).recv(100).decode().strip())'"

# A program built against glibc before 2.33, whose stat calls are glibc's old __xstat family (the version
# it binds to, as such a binary would). Built on the host; the base image's glibc still serves those names.
LEGACY_STAT = r"""#include <stdio.h>
#include <sys/stat.h>
#include <fcntl.h>
int old_xstat(int, const char *, struct stat *);
int old_lxstat(int, const char *, struct stat *);
int old_fxstat(int, int, struct stat *);
__asm__(".symver old_xstat, __xstat@" GLIBC);
__asm__(".symver old_lxstat, __lxstat@" GLIBC);
__asm__(".symver old_fxstat, __fxstat@" GLIBC);
int main(int argc, char **argv) {
  struct stat a, b, c;
  int r = old_xstat(1, argv[1], &a) | old_lxstat(1, argv[1], &b) | old_fxstat(1, open(argv[1], O_RDONLY), &c);
  printf("%d %u:%u %u %u\n", r, a.st_uid, a.st_gid, b.st_uid, c.st_uid);
  return 0;
}
"""
BASE_SYMBOL_VERSION = {"x86_64": "GLIBC_2.2.5", "aarch64": "GLIBC_2.17"}

ASAN_PROBE = r"""#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
  volatile char *p = malloc(4);
  if (argc > 1) p[4] = 1;
  puts("ran");
  return 0;
}
"""

# The agent attacks the shim's path before the verifier comes: each must fail.
PATH_ATTACKS = [f"rm -f {OWNER_SHIM}", f"mv {OWNER_SHIM} /tmp/x", f"cp /bin/true {OWNER_SHIM}",
                f"echo x > {OWNER_SHIM}", f"chmod 777 {OWNER_SHIM}", f"ln -sf /app/evil.so {OWNER_SHIM}",
                "mv /logs /logs2", "touch /logs/.furlong-evil.so", f"umount {OWNER_SHIM}",
                f"mount --bind /app/evil.so {OWNER_SHIM}"]

VERIFIER_CHECKS = {
    "git": "git -C /app/repo log --format=%s && git -C /app/repo status --short",
    "git_unshimmed": "env -u LD_PRELOAD git -C /app/repo log --format=%s",
    "owners": "stat -c %u:%g:%U /app/repo /etc/sudoers /root/.ssh/config; "
              "python3 -c 'import os; print(os.stat(\"/app/data\").st_uid, os.geteuid())'",
    "owners_unshimmed": "env -u LD_PRELOAD stat -c %u:%g /app/repo /etc/sudoers",
    "ssh": "ssh -G somehost | grep -E '^(user|port) '",
    "sudo": "sudo -u nobody id -un",
    "server": f"python3 /tests/server.py /app/data 8124 | {{ read -r line; echo \"$line\"; {QUERY}; }}",
    "secret": "cat /app/secret",
    "service": "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/index.txt').read().decode(), end='')\"",
    "chown": "touch /app/verifiers && chown root:root /app/verifiers && stat -c %u /app/verifiers",
    "preload": "printenv LD_PRELOAD",
    "shim_sha": f"sha256sum < {OWNER_SHIM}",
    "legacy": "/tests/legacy-stat /app/repo",
}


def _compile(out: Path, source: str, *flags: str) -> Path:
    (out.parent / "probe.c").write_text(source)
    subprocess.run(["cc", *flags, "-o", str(out), str(out.parent / "probe.c")], check=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def seen(store, backend, tmp_path_factory) -> dict[str, object]:
    """Everything this module checks, from one sandbox: the agent's setup and attacks, then the verifier."""
    assert backend.subids is not None, f"sandboxes here have one uid: {idmap.problem()}"
    env = tmp_path_factory.mktemp("ownership") / "environment"
    env.mkdir()
    (env / "Dockerfile").write_text(DOCKERFILE)
    glibc = f'-DGLIBC="{BASE_SYMBOL_VERSION[os.uname().machine]}"'
    legacy = _compile(env.parent / "legacy-stat", LEGACY_STAT, glibc).read_bytes()

    async def go() -> dict[str, object]:
        image = await store.image(env / "Dockerfile", backend)
        box = await backend.create(spec(image))
        try:
            out: dict[str, object] = {"setup": await box.exec(AGENT_SETUP, timeout_s=120)}
            await box.exec("cp /usr/lib/*/libm.so.6 /app/evil.so")
            out["attacks"] = [await box.exec(a) for a in PATH_ATTACKS]
            await box.exec("export LD_PRELOAD=/app/evil.so")  # into the agent's shell state
            out["agent_preload"] = await box.exec("printenv LD_PRELOAD; cat /preload-at-build")
            await box.write_file("/tests/server.py", OWNER_CHECKING_SERVER, 0o600, as_verifier=True)
            await box.write_file("/tests/legacy-stat", legacy, 0o700, as_verifier=True)
            for name, cmd in VERIFIER_CHECKS.items():
                out[name] = await box.exec(cmd, timeout_s=60, cwd="/app", as_verifier=True)
            out["task_preload"] = await box.exec("printenv LD_PRELOAD", cwd="/", env={"LD_PRELOAD": "libm.so.6"},
                                                 as_verifier=True)
            out["agent_view"] = await box.exec("stat -c %u /app/verifiers; echo x >> /app/verifiers", cwd="/")
            return out
        finally:
            await box.close()

    return run(go())


def _ok(result) -> str:
    assert result.exit_code == 0, result
    return result.stdout


def test_git_works_on_the_agents_repository_without_safe_directory(seen):
    assert _ok(seen["setup"]) == ""
    assert _ok(seen["git"]) == "agent commit\n"
    bare = seen["git_unshimmed"]  # the uid swap is still there beneath: the shim is what git needed
    assert bare.exit_code != 0 and "dubious ownership" in bare.stderr, bare


def test_the_agents_and_the_images_files_show_as_root_s(seen):
    assert _ok(seen["owners"]).split() == ["0:0:root"] * 3 + ["0", "0"]
    agent = f"{idmap.VERIFIER_UID}:{idmap.VERIFIER_UID}"
    assert _ok(seen["owners_unshimmed"]).split() == [agent, agent]


def test_ssh_accepts_the_agents_config(seen):
    assert _ok(seen["ssh"]).split("\n") == ["user tester", "port 2222", ""]


def test_sudo_runs_a_command_as_another_user(seen):
    assert _ok(seen["sudo"]) == "nobody\n"


def test_programs_built_for_glibc_before_2_33_see_root_too(seen):
    assert _ok(seen["legacy"]) == "0 0:0 0 0\n"


def test_address_sanitizer_programs_run_and_still_check(tmp_path: Path):
    """ASan's shared runtime refuses to run after a preloaded library unless told otherwise (the shim tells it),
    and with the shim first it still catches an overflow. On the host, with gcc's own libasan."""
    exe = _compile(tmp_path / "asan", ASAN_PROBE, "-fsanitize=address", "-g")
    env = {**os.environ, "LD_PRELOAD": str(native.ownership_shim()), "ASAN_OPTIONS": "detect_leaks=0"}
    clean = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60, check=False)
    overflow = subprocess.run([str(exe), "overflow"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (clean.returncode, clean.stdout) == (0, "ran\n"), clean
    assert overflow.returncode != 0 and "heap-buffer-overflow" in overflow.stderr, overflow


def test_an_ownership_checking_server_serves_the_agents_data_directory(seen):
    assert _ok(seen["server"]) == "ready\n42\n"


def test_the_agents_private_file_and_service_are_reachable(seen):
    assert _ok(seen["secret"]) == "secret\n"
    assert _ok(seen["service"]) == "served\n"


def test_chown_to_root_gives_the_file_to_the_verifiers_own_uid(seen):
    assert _ok(seen["chown"]) == "0\n"  # root's, as the verifier sees it ...
    agent_view = seen["agent_view"]  # ... and the verifier's uid to the agent, which cannot write it
    assert agent_view.stdout == f"{idmap.VERIFIER_UID}\n" and agent_view.exit_code != 0, agent_view


def test_only_verifier_commands_preload_the_shim(seen):
    assert _ok(seen["preload"]) == f"{OWNER_SHIM}\n"  # the agent's exported LD_PRELOAD never reaches it
    assert _ok(seen["task_preload"]) == f"libm.so.6:{OWNER_SHIM}\n"  # after the task's own, which keep precedence
    assert _ok(seen["agent_preload"]) == "/app/evil.so\n[]"  # the agent's own value; none at build time


def test_the_agent_can_neither_replace_nor_redirect_the_shim(seen):
    for attack, res in zip(PATH_ATTACKS, seen["attacks"]):
        assert res.exit_code != 0, f"{attack!r} succeeded: {res}"
    shim = native.ownership_shim()
    assert shim is not None
    assert _ok(seen["shim_sha"]).split()[0] == hashlib.sha256(shim.read_bytes()).hexdigest()


def test_sandboxes_with_one_uid_have_no_shim(store, base_image):
    async def go():
        box = await BwrapBackend(layers=store, many_uids=False).create(spec(base_image))
        try:
            return await box.exec(f"printenv LD_PRELOAD; test -e {OWNER_SHIM}; echo $?", as_verifier=True)
        finally:
            await box.close()

    assert run(go()).stdout == "1\n"


def test_unsupported_architectures_get_no_shim_and_one_warning(monkeypatch, caplog):
    # a test double for the machine only: owner.c has system call stubs for x86_64 and aarch64
    monkeypatch.setattr(os, "uname", lambda: os.uname_result(("Linux", "h", "6", "v", "riscv64")))
    native.ownership_shim.cache_clear()
    try:
        assert native.ownership_shim() is None
    finally:
        native.ownership_shim.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if "ownership shim" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("no ownership shim for riscv64"), warnings
