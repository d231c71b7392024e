"""The victim's first step in one process (no server, no flood) with and without another Python thread in the
engine's process: `python` pickles a small reply 20 times every 0.5 ms (as a link's sender would), `sleeper`
only wakes every 0.5 ms. Median wall and engine-thread CPU ms of 60 probes each, in the order printed.

    python busy_thread.py      (from the tree to measure)
"""
import os, sys, tempfile, time, threading, pickle, statistics
from pathlib import Path
import numpy as np
sys.path.insert(0, os.getcwd())
from vlora.config import compose
from vlora.commands.serve import build_engine
from zoo import build_checkpoint
from serve import Request, SamplingParams
home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", "engine.device=cpu", "+engine.num_kv_blocks=48", "engine.max_batch_size=8", f"paths.home={home}"])
eng = build_engine(cfg)
FRAME = np.zeros((32, 32, 3), np.uint8)
def probe():
    vid = eng.add_request(Request(prompt="How many cars?", images=[FRAME], sampling=SamplingParams(max_tokens=2, ignore_eos=True)))
    first = None
    while True:
        outs = eng.step()
        for o in outs:
            if o.request_id == vid and o.finished:
                return o.metrics
stop = threading.Event()
def busy(kind):
    payload = {"tokens": list(range(50)), "text": "x" * 200, "meta": {str(i): i for i in range(30)}}
    while not stop.is_set():
        if kind == "python":
            for _ in range(20): pickle.loads(pickle.dumps(payload))
            time.sleep(0.0005)
        else:
            time.sleep(0.0005)
for label in ("none", "python", "sleeper", "python", "none"):
    stop.clear()
    t = None
    if label != "none":
        t = threading.Thread(target=busy, args=(label,), daemon=True); t.start()
    for _ in range(10): probe()
    ms = [probe() for _ in range(60)]
    stop.set()
    if t: t.join()
    f = [m.first_step_s * 1e3 for m in ms]; c = [m.first_step_cpu_s * 1e3 for m in ms]
    print(label, "first step wall median", round(statistics.median(f), 2), "cpu median", round(statistics.median(c), 2))
