"""A one-core matrix loop (and a Python loop) timed with the other core idle, running a Python busy loop, or running
the same matrix loop (each pinned with taskset): wall and CPU ms of three rounds each.

    python other_core.py
"""
import time, os, sys, subprocess
import torch
torch.set_num_threads(1)
os.sched_setaffinity(0, {0})
a = torch.randn(128, 512); w = torch.randn(512, 512)
def work():
    t = time.perf_counter(); c0 = time.thread_time()
    for _ in range(2000): a @ w
    return (time.perf_counter() - t) * 1e3, (time.thread_time() - c0) * 1e3
def pyw():
    t = time.perf_counter(); x = 0
    for i in range(2_000_000): x += i
    return (time.perf_counter() - t) * 1e3
for label in ("idle", "busy-py", "busy-mm", "idle"):
    p = None
    if label == "busy-py":
        p = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"])
    if label == "busy-mm":
        p = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "import torch;torch.set_num_threads(1);a=torch.randn(128,512);w=torch.randn(512,512)\nwhile True: a@w"])
    time.sleep(1.0)
    r = [work() for _ in range(3)]; py = [pyw() for _ in range(3)]
    print(label, "matmul wall/cpu ms", [(round(x), round(y)) for x, y in r], "py loop ms", [round(x) for x in py])
    if p: p.kill(); p.wait()
