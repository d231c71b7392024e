"""The engine's decode step (8 sequences, tiny model) with torch threads T, the other core idle or running a busy
process: median wall and thread-CPU ms per step."""
import os, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from serve import Request, SamplingParams
from vlora.commands.serve import build_engine
from vlora.config import compose
from zoo import build_checkpoint
threads = int(sys.argv[1]); torch.set_num_threads(threads)
home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", "engine.device=cpu", "+engine.num_kv_blocks=512",
                        "engine.max_batch_size=32", f"paths.home={home}"])
eng = build_engine(cfg)
if eng.needs_warm_up: eng.warm_up()
frame = np.zeros((32, 32, 3), np.uint8)
def run(batch):
    for _ in range(batch):
        eng.add_request(Request(prompt="Describe.", images=[frame], sampling=SamplingParams(max_tokens=120, ignore_eos=True)))
    w, c = [], []
    for i in range(120):
        t = time.perf_counter(); c0 = time.thread_time(); eng.step()
        if 30 <= i < 110: w.append((time.perf_counter() - t) * 1e3); c.append((time.thread_time() - c0) * 1e3)
    while eng.has_unfinished(): eng.step()
    return round(statistics.median(w), 2), round(statistics.median(c), 2)
for label in ("idle", "busy", "idle", "busy"):
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if label == "busy" else None
    time.sleep(0.5)
    print(threads, label, "b1", run(1), "b8", run(8), flush=True)
    if p: p.kill(); p.wait()
