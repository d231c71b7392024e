"""The soak's CPU windows: a process's CPU counts for the group of the root it descends from."""
import subprocess
import sys
import time

import pytest

from bench.soak_cpu import CpuWindow

# a parent that sleeps while its child spins: the group's CPU is the grandchild's, two levels down
SPINNING_CHILD = ("import subprocess, sys, time; "
                  "c = subprocess.Popen([sys.executable, '-c', 'import time\\nt = time.time()\\nwhile time.time() - t < 30: pass']); "
                  "print(c.pid, flush=True); time.sleep(30)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_grandchilds_cpu_counts_for_its_roots_group_and_an_idle_root_for_none():
    busy = subprocess.Popen([sys.executable, "-c", SPINNING_CHILD], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        spinner = int(busy.stdout.readline())  # the child runs: the window sees it from its start
        window = CpuWindow({"busy": [busy.pid], "idle": [idle.pid]}).start()
        time.sleep(1.5)
        got = window.stop()
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
        subprocess.run(["kill", "-9", str(spinner)], check=False)
    assert set(got["cores"]) == {"busy", "idle", "other"}, got
    assert 1.3 <= got["window_s"] <= 5, got
    # one spinning process on a machine of two or more cores: most of a core, even with the tests beside it
    assert got["cores"]["busy"] >= 0.3, got
    assert got["cores"]["idle"] <= 0.05, got
    assert got["busiest_process_cores"]["busy"] == pytest.approx(got["cores"]["busy"], abs=0.05), got
    assert got["machine_busy_cores"] >= got["cores"]["busy"] - 0.1, got


def test_stop_before_start_is_refused():
    with pytest.raises(RuntimeError, match="before start"):
        CpuWindow({}).stop()
