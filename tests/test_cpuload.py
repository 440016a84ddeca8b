"""bench/cpuload.py, which the async bench uses to say whether overlap had spare cores and who used them:
a busy loop shows up as a busy core, in its process's main thread or other threads as it ran, and a
window holding fewer than two samples has no figure."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("cpuload", Path(__file__).resolve().parent.parent / "bench" / "cpuload.py")
cpuload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpuload)

# spins for 2 s of its own thread's CPU time, not of wall time: on a busy machine the loop takes longer
# but still burns the same CPU, which is what the meter must attribute to it
SPIN_S = 2.0
SPIN = f"import time\nt = time.thread_time()\nwhile time.thread_time() - t < {SPIN_S}: pass\n"
IN_A_THREAD = f"import threading\nthreading.Thread(target=exec, args=({SPIN!r},)).start()\n"


def test_busy_loops_count_as_busy_cores_of_the_process_and_thread_that_ran_them() -> None:
    names = {"main": "# cpuload-test-main", "thread": "# cpuload-test-thread"}
    with cpuload.CpuMeter(names, every_s=0.2) as meter:
        time.sleep(0.5)  # two samples before the loops start
        start = time.time()
        procs = [subprocess.Popen([sys.executable, "-c", SPIN + names["main"]]),
                 subprocess.Popen([sys.executable, "-c", IN_A_THREAD + names["thread"]])]
        for proc in procs:
            proc.wait(timeout=60)
        time.sleep(0.5)
        end = time.time()
    busy, by = meter.cores_busy(start, end), meter.cores_by_process(start, end)
    assert busy is not None and by is not None
    spun = SPIN_S / (end - start)  # the cores each loop kept busy on average over the window
    assert by["main main thread"] >= 0.5 * spun and by["main other threads"] <= 0.1, by
    assert by["thread other threads"] >= 0.5 * spun and by["thread main thread"] <= 0.1, by
    assert busy >= by["main main thread"] + by["thread other threads"] - 0.05, (busy, by)
    assert meter.cores_busy(end + 10, end + 20) is None and meter.cores_by_process(start - 100, start - 50) is None
