"""bench/cpuload.py, which the async bench uses to say whether overlap had spare cores: a busy loop shows up
as a busy core, and a window holding fewer than two samples has no figure."""

import importlib.util
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("cpuload", Path(__file__).resolve().parent.parent / "bench" / "cpuload.py")
cpuload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpuload)


def test_a_busy_loop_counts_as_a_busy_core() -> None:
    with cpuload.CpuMeter(every_s=0.2) as meter:
        start = time.time()
        while time.time() - start < 2.0:
            pass  # one core busy (this thread), whatever else the machine does
        end = time.time()
    busy = meter.cores_busy(start, end)
    assert busy is not None and busy >= 0.7, busy
    assert meter.cores_busy(end + 10, end + 20) is None
    assert meter.cores_busy(start - 100, start - 50) is None
