"""pause, connect (resume) and get_metrics through the real e2b SDK, over real bwrap sandboxes: the metrics
are the sandbox's own cgroup's, and a paused sandbox's processes get no CPU until it is connected again."""

from __future__ import annotations

import time

import e2b
import pytest
from test_e2b_api import TEMPLATE, monkeypatch_module, server  # noqa: F401  (fixtures)


def _busy_pct(sbx) -> float:
    (sample,) = sbx.get_metrics()
    return sample.cpu_used_pct


def test_pause_connect_and_metrics_through_the_sdk(server):  # noqa: F811
    _url, app = server
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        sbx.commands.run("while :; do :; done >/dev/null 2>&1 &", background=True)
        sbx.commands.run("head -c 50000000 /dev/zero > /root/fill")  # 50 MB of tmpfs pages: charged memory
        _busy_pct(sbx)  # the first sample counts from the start; the next from it
        time.sleep(1.0)  # CPU time counts in ticks of 10 ms: a window of 100 of them
        (sample,) = sbx.get_metrics()
        assert sample.cpu_used_pct > 2 and sample.cpu_count == 1  # 2 cores shared with other jobs: a share of one
        assert 50_000_000 < sample.mem_used < sample.mem_total == 2048 << 20
        assert sample.disk_total == int(sbx.commands.run("df -B1 --output=size / | tail -1").stdout)
        assert sbx.pause() is True
        assert e2b.Sandbox.pause(sbx.sandbox_id) is False  # already paused: the SDK's answer to a 409
        assert app.state.registry.live[sbx.sandbox_id].box.paused
        _busy_pct(sbx)
        time.sleep(1.0)
        assert _busy_pct(sbx) < 1  # frozen: the loop gets no CPU, not one tick
        with pytest.raises(e2b.SandboxException, match=r"paused: Sandbox\.connect resumes it"):
            sbx.commands.run("true")
        again = e2b.Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.sandbox_id == sbx.sandbox_id and not app.state.registry.live[sbx.sandbox_id].box.paused
        assert again.commands.run("stat -c %s /root/fill").stdout == "50000000\n"
        _busy_pct(again)
        time.sleep(1.0)
        assert _busy_pct(again) > 2  # the same loop, going on
        assert e2b.Sandbox.connect(sbx.sandbox_id).sandbox_id == sbx.sandbox_id  # running: answered as it is
    finally:
        sbx.kill()
