"""The engine's decode step on this CPU with B sequences decoding at once (the tiny model, one picture each,
contexts about 60-160 tokens): median wall ms per step over its steps 40-140, in one process (no server).

    python decode_steps.py OUT.json [overrides...]     (run from the tree to measure)
"""
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.getcwd())
from serve import Request, SamplingParams  # noqa: E402
from vlora.commands.serve import build_engine  # noqa: E402
from vlora.config import compose  # noqa: E402
from zoo import build_checkpoint  # noqa: E402

home = Path(tempfile.mkdtemp())
ckpt = build_checkpoint("qwen2_vl_tiny", home / "zoo")
cfg = compose("serve", [f"model.path={ckpt}", "engine.device=cpu", "+engine.num_kv_blocks=512",
                        "engine.max_batch_size=32", f"paths.home={home}"] + sys.argv[2:])
eng = build_engine(cfg)
if eng.needs_warm_up:
    eng.warm_up()
frame = np.zeros((32, 32, 3), np.uint8)
rows = {}
for batch in (1, 2, 4, 8, 16, 32):
    for _ in range(batch):
        eng.add_request(Request(prompt="Describe.", images=[frame],
                                sampling=SamplingParams(max_tokens=150, ignore_eos=True)))
    times = []
    for i in range(150):
        t = time.perf_counter()
        eng.step()
        if 40 <= i < 140:
            times.append((time.perf_counter() - t) * 1e3)
    while eng.has_unfinished():
        eng.step()
    rows[batch] = round(statistics.median(times), 3)
    print(batch, rows[batch], "ms", flush=True)
Path(sys.argv[1]).write_text(json.dumps({"median_step_ms_by_batch": rows}, indent=1))
