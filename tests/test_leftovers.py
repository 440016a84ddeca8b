"""Nothing left behind: a buildah build (as root its RUN steps in a pasta network namespace), a networked
sandbox and a short `furlong eval --agent oracle` on a bundled task leave no process, namespace, mount
or cgroup on the host, also with the host's CA bundle bound into the build and the sandbox; nor does a
SIGKILLed sandbox host once a new one starts. Counted by tests/leftovers_probe.py, a child subreaper (its
docstring says why)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from furlong.sandbox.runtime.egress import default_ca_bundle

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("host_ca", [False, True], ids=["plain", "trust_host_ca"])
def test_build_networked_sandbox_and_eval_leave_nothing_on_the_host(tmp_path: Path, host_ca: bool):
    # trust_host_ca: the build and the sandbox also bind the host's CA bundle and get its mirror settings
    bundle = [str(default_ca_bundle())] if host_ca else []
    proc = subprocess.run([sys.executable, str(ROOT / "tests/leftovers_probe.py"), str(ROOT), str(tmp_path), *bundle],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["before"]["mounts"] > 0  # the counts read something
    assert report["left"] == {"processes": [], "namespaces": [], "mounts": [], "cgroups": []}, report


def test_a_sigkilled_host_leaves_nothing_once_a_new_host_starts(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests/leftovers_probe.py"), str(ROOT), str(tmp_path),
                           "--killed-host"], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["live"]["processes"] >= 3 * 3 and report["live"]["cgroups"] > 0  # bwrap, init, sleeps: counted
    killed = report["killed_left"]
    # Its sandboxes end with it (each init exits when the host's end of its channel closes); their cgroups stay
    assert killed["processes"] == killed["namespaces"] == killed["mounts"] == killed["files"] == [], killed
    assert killed["cgroups"], "a killed host cannot remove its sandboxes' cgroups"
    assert report["left"] == {"processes": [], "namespaces": [], "mounts": [], "cgroups": [], "files": []}, report
    assert report["dead_host_cgroups"] == [] and "removed" in report["new_host_log"], report
