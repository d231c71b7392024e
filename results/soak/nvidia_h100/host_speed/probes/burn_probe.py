"""Does other work on the host's other cores slow the engine's steps? One engine in process, the victim alone,
its first step's forward host time and step time, with k busy processes (pure Python loops) on other cores,
the engine unpinned or pinned to one core (the busy ones then kept off it)."""
import json, multiprocessing as mp, os, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from vlora.config import compose
from vlora.commands.serve import build_engine
from zoo import build_checkpoint
from serve import Request, SamplingParams

def burn(cores):
    if cores:
        os.sched_setaffinity(0, cores)
    x = list(range(20000))
    while True:
        s = 0
        for v in x:
            s += v

if __name__ == "__main__":
    out = Path(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    home = Path(tempfile.mkdtemp())
    ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
    cfg = compose("serve", [f"model.path={ckpt}", "engine.device=cuda", "+engine.num_kv_blocks=48",
                            "engine.max_batch_size=8", f"paths.home={home}"])
    eng = build_engine(cfg)
    if eng.needs_warm_up:
        eng.warm_up()
    FRAME = np.zeros((32, 32, 3), np.uint8)
    runner, orig, REC = eng.runner, eng.runner._forward, []
    def fwd(inputs):
        t = time.perf_counter(); h = orig(inputs); REC.append(time.perf_counter() - t); return h
    runner._forward = fwd
    def probe(i):
        vid = eng.add_request(Request(prompt="How many cars?", images=[FRAME + i % 5],
                                      sampling=SamplingParams(max_tokens=2, ignore_eos=True)))
        k, t = len(REC), time.perf_counter()
        first = None
        while True:
            outs = eng.step()
            if first is None:
                first = (time.perf_counter() - t, REC[k])
            if any(o.request_id == vid and o.finished for o in outs):
                return first[0], first[1], time.perf_counter() - t
    allcores = sorted(os.sched_getaffinity(0))
    res = {"cores": len(allcores)}
    configs = [("free", 0, False), ("free", 3, False), ("free", 8, False), ("free", 14, False),
               ("pinned", 0, True), ("pinned", 3, True), ("pinned", 8, True), ("pinned", 14, True),
               ("free", 0, False), ("free", 3, False)]
    if os.environ.get("KS"):  # rounds of k busy processes, unpinned, e.g. KS="0 1 2 3 0 1 2 3"
        configs = [("free", int(k), False) for k in os.environ["KS"].split()]
    for rnd, (name, k, pin) in enumerate(configs):
        os.sched_setaffinity(0, {allcores[0]} if pin else set(allcores))
        others = set(allcores[2:]) if pin else None
        procs = [mp.Process(target=burn, args=(others,), daemon=True) for _ in range(k)]
        for p in procs:
            p.start()
        time.sleep(1.0)
        for i in range(10):
            probe(i)
        rows = [probe(i) for i in range(n)]
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        step = [r[0] * 1e3 for r in rows]; fw = [r[1] * 1e3 for r in rows]; tot = [r[2] * 1e3 for r in rows]
        key = f"{rnd}_{name}_{k}"
        res[key] = {"first_step_ms": [round(float(np.percentile(step, q)), 3) for q in (50, 90)],
                    "forward_ms": [round(float(np.percentile(fw, q)), 3) for q in (50, 90)],
                    "request_ms": [round(float(np.percentile(tot, q)), 3) for q in (50, 90)]}
        print(key, res[key], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "burn_probe.json").write_text(json.dumps(res, indent=1))
