"""32 threads of one tenant calling through the gate (0.2 ms of CPU each call), with another tenant calling
every 20 ms, for 3 s: the process's CPU time against the CPU spent inside the calls.
Run from the tree to measure (its root as the working directory): python PATH/herd.py"""
import os
import sys
import threading
import time

sys.path.insert(0, os.getcwd())
from serve.rpc.gate import Gate  # noqa: E402

gate = Gate(slots=1, share=0.5)
stop = threading.Event()
calls = [0]

def burn(s):
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass

def flood(i):
    while not stop.is_set():
        with gate.call(f"c{i}", "flood"):
            burn(0.0002)
        calls[0] += 1

def victim():
    while not stop.is_set():
        with gate.call("v", "victim"):
            burn(0.001)
        time.sleep(0.02)

ts = [threading.Thread(target=flood, args=(i,)) for i in range(32)] + [threading.Thread(target=victim)]
p0, w0 = time.process_time(), time.monotonic()
for t in ts: t.start()
time.sleep(3)
stop.set()
for t in ts: t.join()
cpu, wall = time.process_time() - p0, time.monotonic() - w0
print(f"process CPU {cpu / wall:.2f} cores; flood calls {calls[0]}, inside {calls[0] * 0.0002 / wall:.2f} of the clock; "
      f"paced_s {gate.counters['paced_s']:.1f}")
