"""Runs inside the generator sandbox (furlong/tasks/genrun.py); furlong itself never imports it.

argv: FAMILY_DIR OUT_DIR LIB_DIR SEED... (LIB_DIR holds the furlong package). Imports FAMILY_DIR/generate.py,
and for every seed calls generate(seed, OUT_DIR/seed) and sends that tree to the host on stdout (deleting
sent trees whenever /out, a small tmpfs, is a quarter full). The stream is JSON header lines, a file's bytes after its header:
  {"seed": 3}  {"dir": "tests"}  {"file": "tests/test.sh", "mode": 493, "size": 52} + 52 bytes
  ... {"end": true}, or {"error": "one line"} on a failure.
Nothing here is trusted: the generator runs in this process and could rewrite it, so the host checks
every record and creates every file itself. This code is what gives an honest generator clear errors.
"""

import importlib.util
import json
import os
import shutil
import signal
import stat
import sys
from pathlib import Path
from typing import NoReturn

ONLY = "generated instances may hold only regular files and directories"


def send(stream, header: dict, data: bytes = b"") -> None:
    stream.write(json.dumps(header).encode() + b"\n" + data)


def fail(stream, problem: str) -> NoReturn:
    send(stream, {"error": problem})
    stream.flush()
    os._exit(3)


def send_tree(stream, root: str, seed: int) -> None:
    send(stream, {"seed": seed})
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinks
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel, st = path[len(root) + 1 :], os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                fail(stream, f"generate({seed}) made {rel} a symlink (to {os.readlink(path)!r}); {ONLY}")
            elif stat.S_ISDIR(st.st_mode):
                send(stream, {"dir": rel})
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    data = f.read()
                send(stream, {"file": rel, "mode": st.st_mode & 0o777, "size": len(data)}, data)
            else:
                fail(stream, f"generate({seed}) made {rel} a fifo, socket or device file; {ONLY}")
    stream.flush()


def make_room(out: Path, sent: list[Path]) -> None:
    """Deletes the instances already sent once /out is a quarter full (deleting each costs more)."""
    fs = os.statvfs(out)
    if (fs.f_blocks - fs.f_bfree) * 4 > fs.f_blocks:
        for d in sent:
            shutil.rmtree(d)
        sent.clear()


def main() -> None:
    family, out, lib = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    seeds = [int(s) for s in sys.argv[4:]]
    stream = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the generator prints goes to stderr, never into the stream
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file over RLIMIT_FSIZE raises EFBIG, not a silent kill
    sys.path.insert(0, lib)  # furlong.tasks.kit, which families use
    module_name = "furlong_family_" + family.name.replace("-", "_")
    spec = importlib.util.spec_from_file_location(module_name, family / "generate.py")
    if spec is None or spec.loader is None:
        fail(stream, f"{family / 'generate.py'}: not importable as a module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: every failure is one line for the host
        fail(stream, f"import failed: {exc!r}")
    generate = getattr(module, "generate", None)
    if not callable(generate):
        fail(stream, "defines no generate(seed, out) function")
    sent: list[Path] = []
    for seed in seeds:
        make_room(out, sent)
        (out / str(seed)).mkdir()
        try:
            generate(seed, out / str(seed))
        except BaseException as exc:  # noqa: BLE001
            fail(stream, f"generate({seed}) failed: {exc!r}")
        send_tree(stream, str(out / str(seed)), seed)
        sent.append(out / str(seed))
    send(stream, {"end": True})
    stream.flush()


if __name__ == "__main__":
    main()
