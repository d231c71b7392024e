"""The soak victim's first step in process, Python-level: alone (16 new tokens), beside one flood request,
and alone with a longer prompt (about as many new tokens as the pair); each step's host phases, then
cProfile's top functions over the first steps of each kind."""
import cProfile, io, json, os, pstats, sys, tempfile
from pathlib import Path
import numpy as np
sys.path.insert(0, os.getcwd())
from vlora.config import compose
from vlora.commands.serve import build_engine
from zoo import build_checkpoint
from serve import Request, SamplingParams
from serve.engine.request import phases_ms

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
out = Path(sys.argv[3] if len(sys.argv) > 3 else ".")
home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", f"engine.device={dev}", "+engine.num_kv_blocks=48", "engine.max_batch_size=8",
                        f"paths.home={home}"] + sys.argv[4:])
eng = build_engine(cfg)
if eng.needs_warm_up:
    eng.warm_up()
FRAME = np.zeros((32, 32, 3), np.uint8)
def req(prompt, tenant, tokens):
    return Request(prompt=prompt, images=[FRAME], sampling=SamplingParams(max_tokens=tokens, ignore_eos=True), tenant=tenant)
KINDS = {"alone": lambda: [req("How many cars?", "victim", 2)],
         "pair": lambda: [req("How many cars?", "victim", 2), req("Describe.", "attacker", 1)],
         "long_alone": lambda: [req("Count them all, one by one, and then say how many there are. " * 2 + "How many cars?", "victim", 2)]}
runner = eng.runner
orig = runner.run
prof = {"on": None}
def run(batch, ahead=None):
    p = prof["on"] if not batch.decode_only else None
    if p is None:
        return orig(batch, ahead)
    p.enable()
    try:
        return orig(batch, ahead)
    finally:
        p.disable()
runner.run = run
def go(reqs):
    ids = [eng.add_request(r) for r in reqs]
    done = {}
    while len(done) < len(ids):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done[ids[0]].metrics
rows = {}
for label, make in KINDS.items():
    for _ in range(5):
        go(make())
    ms = [go(make()) for _ in range(n)]
    rows[label] = {"first_step_ms": float(np.median([m.first_step_s * 1e3 for m in ms])),
                   "first_tokens": float(np.median([m.first_step_tokens for m in ms])),
                   "first_phases_ms": {k: float(np.median([phases_ms(m.first_phases_s)[k] for m in ms])) for k in phases_ms(ms[0].first_phases_s)}}
    p = cProfile.Profile()
    prof["on"] = p
    for _ in range(20):
        go(make())
    prof["on"] = None
    s = io.StringIO()
    pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(30)
    rows[label]["cprofile"] = s.getvalue()
    print(label, json.dumps({k: v for k, v in rows[label].items() if k != "cprofile"}))
    print("\n".join(l[:170] for l in s.getvalue().splitlines()[6:40]))
out.mkdir(parents=True, exist_ok=True)
(out / f"prof_py_{dev}.json").write_text(json.dumps(rows, indent=1))
