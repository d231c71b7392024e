"""The soak victim's first step in process: alone, and beside one flood request; host phases and the
profiler's top operators of one such step each way."""
import json, os, sys, tempfile, time
from pathlib import Path
import numpy as np
sys.path.insert(0, os.getcwd())
from vlora.config import compose
from vlora.commands.serve import build_engine
from zoo import build_checkpoint
from serve import Request, SamplingParams
from serve.engine.request import phases_ms

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
out = Path(sys.argv[3] if len(sys.argv) > 3 else ".")
home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", f"engine.device={dev}", "+engine.num_kv_blocks=48", "engine.max_batch_size=8",
                        f"paths.home={home}"] + sys.argv[4:])
eng = build_engine(cfg)
if eng.needs_warm_up:
    eng.warm_up()
FRAME = np.zeros((32, 32, 3), np.uint8)
def victim():
    return Request(prompt="How many cars?", images=[FRAME], sampling=SamplingParams(max_tokens=2, ignore_eos=True), tenant="victim")
def flood():
    return Request(prompt="Describe.", images=[FRAME], sampling=SamplingParams(max_tokens=1, ignore_eos=True), tenant="attacker")
def run(reqs, profile=False):
    ids = [eng.add_request(r) for r in reqs]
    if profile:
        eng.profile_steps(1)
    done = {}
    while len(done) < len(ids):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done[ids[0]].metrics
rows = {}
for label, make in (("alone", lambda: [victim()]), ("pair", lambda: [victim(), flood()])):
    for _ in range(5):
        run(make())
    ms = [run(make()) for _ in range(n)]
    rows[label] = {"first_step_ms": float(np.median([m.first_step_s * 1e3 for m in ms])),
                   "first_step_cpu_ms": float(np.median([m.first_step_cpu_s * 1e3 for m in ms])),
                   "last_step_ms": float(np.median([m.last_step_s * 1e3 for m in ms])),
                   "last_step_cpu_ms": float(np.median([m.last_step_cpu_s * 1e3 for m in ms])),
                   "first_tokens": float(np.median([m.first_step_tokens for m in ms])),
                   "first_phases_ms": {k: float(np.median([phases_ms(m.first_phases_s)[k] for m in ms])) for k in phases_ms(ms[0].first_phases_s)},
                   "last_phases_ms": {k: float(np.median([phases_ms(m.last_phases_s)[k] for m in ms])) for k in phases_ms(ms[0].last_phases_s)}}
    run(make(), profile=True)
    rows[label]["profile"] = eng.step_profiler_done.results if eng.step_profiler_done else None
    print(label, json.dumps({k: v for k, v in rows[label].items() if k != "profile"}))
    for op in (rows[label]["profile"] or [{}])[0].get("ops", [])[:25]:
        print("   ", op)
out.mkdir(parents=True, exist_ok=True)
(out / f"prof_{dev}.json").write_text(json.dumps(rows, indent=1))
