"""The soak's victim against a flood of one-token picture requests, in one process (no server): does the victim's
first step slow as it does in the server? Its first steps alone and under the flood: wall, CPU, host phases, and
the profiler's top operators of a few such steps each way."""
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
n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
out = Path(sys.argv[3] if len(sys.argv) > 3 else ".")
depth = int(sys.argv[4]) if len(sys.argv) > 4 else 256
home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", f"engine.device={dev}", "+engine.num_kv_blocks=48", "engine.max_batch_size=8",
                        f"paths.home={home}"] + sys.argv[5:])
eng = build_engine(cfg)
if eng.needs_warm_up:
    eng.warm_up()
FRAME = np.zeros((32, 32, 3), np.uint8)
def victim():
    return Request(prompt="How many cars?", images=[FRAME], sampling=SamplingParams(max_tokens=2, ignore_eos=True), tenant="victim")
def flood():
    return Request(prompt="Describe.", images=[FRAME], sampling=SamplingParams(max_tokens=int(os.environ.get("FLOOD_TOKENS", "1")), ignore_eos=True), tenant="attacker")
flooding = {"on": False, "ids": set()}
def top_up():
    while flooding["on"] and len(flooding["ids"]) < depth:
        flooding["ids"].add(eng.add_request(flood()))
def probe(profile=False):
    vid = eng.add_request(victim())
    if profile:
        eng.profile_steps(1)
    first = True
    while True:
        outs = eng.step()
        if first:
            COMPOSITION.append(eng.step_log[-1][:2])
            first = False
        for o in outs:
            if o.request_id in flooding["ids"] and o.finished:
                flooding["ids"].discard(o.request_id)
            if o.request_id == vid and o.finished:
                top_up()
                return o.metrics
        top_up()
rows = {}
COMPOSITION = []
for label in ("alone", "flood"):
    flooding["on"] = label == "flood"
    top_up()
    for _ in range(20):  # the flood's steps running, the victim's first ones not kept
        for _ in range(3):
            for o in eng.step():
                if o.finished:
                    flooding["ids"].discard(o.request_id)
            top_up()
        probe()
    ms = []
    for _ in range(n):
        for _ in range(3):  # a few of the flood's steps between probes, as in the soak
            for o in eng.step():
                if o.finished:
                    flooding["ids"].discard(o.request_id)
            top_up()
        ms.append(probe())
    tail = sorted(ms, key=lambda m: m.first_step_s)[-max(1, n // 10):]
    def summary(rows_):
        return {"first_step_ms": round(float(np.mean([m.first_step_s * 1e3 for m in rows_])), 3),
                "first_step_cpu_ms": round(float(np.mean([m.first_step_cpu_s * 1e3 for m in rows_])), 3),
                "first_tokens": round(float(np.mean([m.first_step_tokens for m in rows_])), 1),
                "last_step_ms": round(float(np.mean([m.last_step_s * 1e3 for m in rows_])), 3),
                "last_step_cpu_ms": round(float(np.mean([m.last_step_cpu_s * 1e3 for m in rows_])), 3),
                "first_phases_ms": {k: round(float(np.mean([phases_ms(m.first_phases_s)[k] for m in rows_])), 3) for k in phases_ms(rows_[0].first_phases_s)}}
    rows[label] = {"all": summary(ms), "tail": summary(tail)}
    comp = COMPOSITION[-n:]
    rows[label]["first_step_seqs"] = float(np.mean([c[0] for c in comp]))
    rows[label]["first_step_tokens_log"] = float(np.mean([c[1] for c in comp]))
    del COMPOSITION[:]
    profiles = []
    for _ in range(5):
        for _ in range(3):
            for o in eng.step():
                if o.finished:
                    flooding["ids"].discard(o.request_id)
            top_up()
        probe(profile=True)
        profiles += eng.step_profiler_done.results if eng.step_profiler_done else []
    rows[label]["profiles"] = profiles
    print(label, json.dumps({k: v for k, v in rows[label].items() if k != "profiles"}))
    for prof in profiles[:2]:
        print("  wall", prof["wall_ms"])
        for op in prof["ops"][:18]:
            print("   ", op)
flooding["on"] = False
out.mkdir(parents=True, exist_ok=True)
(out / f"prof_flood_{dev}.json").write_text(json.dumps(rows, indent=1))
