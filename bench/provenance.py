"""Where a benchmark result came from: the command as typed, the commit, the machine and its load.

Every bench script that writes a JSON under bench/results/ embeds `provenance()` under a top-level
`provenance` key, called once at start (load average before) and finished by `finish()` just before the
JSON is written (load average after, seconds), so a figure can be traced to its run and its conditions.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _git(root: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def _torch_version() -> str | None:
    if "torch" not in sys.modules:  # importing torch costs seconds; a script that uses it has it loaded
        return None
    return sys.modules["torch"].__version__


def command() -> str:
    """The command as it would be retyped from the repository root: `python bench/x.py --flag value`."""
    return shlex.join(["python", *sys.argv])


def provenance(root: Path = ROOT) -> dict[str, Any]:
    """Command, commit (with `dirty`), machine and start time; call at the start of a run."""
    status = _git(root, "status", "--porcelain")
    return {
        "command": command(),
        "commit": _git(root, "rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "hostname": platform.node(),
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "cpu_model": _cpu_model(),
            "memory_bytes": _memory_bytes(),
            "loadavg_start": list(os.getloadavg()),
            "loadavg_end": None,
            "python": platform.python_version(),
            "torch": _torch_version(),
        },
        "_t0": time.monotonic(),
    }


def finish(prov: dict[str, Any]) -> dict[str, Any]:
    """A copy of `prov` with the end-of-run load average and the run's wall seconds; call before writing."""
    out = {k: v for k, v in prov.items() if k != "_t0"}
    out["machine"] = prov["machine"] | {"loadavg_end": list(os.getloadavg()),
                                         "torch": prov["machine"]["torch"] or _torch_version()}
    out["seconds"] = round(time.monotonic() - prov["_t0"], 1)
    return out
