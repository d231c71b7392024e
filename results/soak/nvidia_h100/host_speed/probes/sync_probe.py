"""Victim's first step alone and beside the flood's prompts, one engine in process: the forward's host launch
time, its device time (events) and whether the stream was idle when it started; then the ops that synchronize."""
import json, os, sys, tempfile, time, warnings, traceback
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from vlora.config import compose
from vlora.commands.serve import build_engine
from zoo import build_checkpoint
from serve import Request, SamplingParams

out = Path(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", "engine.device=cuda", "+engine.num_kv_blocks=48", "engine.max_batch_size=8",
                        f"paths.home={home}"] + sys.argv[3:])
eng = build_engine(cfg)
if eng.needs_warm_up:
    eng.warm_up()
FRAME = np.zeros((32, 32, 3), np.uint8)
runner = eng.runner
orig = runner._forward
REC = []
def fwd(inputs):
    idle = torch.cuda.current_stream().query()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); t = time.perf_counter()
    h = orig(inputs)
    host = time.perf_counter() - t
    b.record()
    REC.append((a, b, host, idle, int(inputs.input_ids.shape[0])))
    return h
runner._forward = fwd
def victim():
    return Request(prompt="How many cars?", images=[FRAME + len(REC) % 7], sampling=SamplingParams(max_tokens=2, ignore_eos=True), tenant="victim")
def flood():
    return Request(prompt="Describe.", images=[FRAME], sampling=SamplingParams(max_tokens=1, ignore_eos=True), tenant="attacker")
pending = set()
def top_up(on):
    while on and len(pending) < 256:
        pending.add(eng.add_request(flood()))
def probe(on):
    vid = eng.add_request(victim())
    first = None
    while True:
        k = len(REC)
        outs = eng.step()
        if first is None and len(REC) > k:
            first = REC[-1]
        for o in outs:
            if o.finished:
                pending.discard(o.request_id)
            if o.request_id == vid and o.finished:
                top_up(on)
                return first
        top_up(on)
res = {}
for label in ("alone", "flood", "alone2", "flood2"):
    on = label.startswith("flood")
    if not on:
        for rid in list(pending):
            eng.abort(rid)
        while eng.has_unfinished():
            for o in eng.step():
                pending.discard(o.request_id)
        pending.clear()
    top_up(on)
    rows = []
    for i in range(n + 10):
        for _ in range(3):
            for o in eng.step():
                if o.finished:
                    pending.discard(o.request_id)
            top_up(on)
        r = probe(on)
        if i >= 10:
            rows.append(r)
    torch.cuda.synchronize()
    host = [r[2] * 1e3 for r in rows]; dev = [r[0].elapsed_time(r[1]) for r in rows]
    idle = [r[3] for r in rows]; tok = [r[4] for r in rows]
    res[label] = {"host_launch_ms": [round(float(np.percentile(host, q)), 3) for q in (50, 90)],
                  "device_ms": [round(float(np.percentile(dev, q)), 3) for q in (50, 90)],
                  "stream_idle_at_start": sum(idle) / len(idle), "tokens": float(np.mean(tok))}
    print(label, res[label], flush=True)
# which ops synchronize inside a forward (one flood probe)
found = []
def show(message, category, filename, lineno, file=None, line=None):
    stack = [f for f in traceback.format_stack() if "/serve/" in f or "/vlora_kernels/" in f]
    found.append({"msg": str(message)[:200], "stack": [s.strip()[:300] for s in stack[-4:]]})
warnings.showwarning = show
top_up(True)
torch.cuda.set_sync_debug_mode(1)
runner._forward = orig
probe(True)
torch.cuda.set_sync_debug_mode(0)
res["syncs"] = found
print(json.dumps(found[:20], indent=1))
out.mkdir(parents=True, exist_ok=True)
(out / "sync_probe.json").write_text(json.dumps(res, indent=1))
