import os, sys, time, traceback
import torch
from vlora_kernels.timing import time_op
from bench.vision import towers, VisionBenchJob, run_vision_bench
from bench.vision_lora import time_tower_lora
from zoo.build import build_tokenizer_and_ids
from zoo.configs import hf_config
from zoo.specs import get_spec

print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
for name in ("qwen2_vl_7b", "qwen2_5_vl_7b"):
    spec = get_spec(name)
    torch.manual_seed(0)
    _, ours = towers(hf_config(spec, build_tokenizer_and_ids(spec)[1]).vision_config, spec.arch, "cuda", torch.bfloat16)
    width = ours.patch_embed.proj.weight[0].numel()
    for n in (1, 8, 32):
        grids = [(1, 32, 32)] * (3 * n)  # n camera chunks of 6 frames at 448^2: 3 frame groups each
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            row = time_tower_lora(ours, pixels, grids, 16, 4,
                                  lambda fn: time_op(fn, warmup=2, repeats=10, use_graph=False) / 1e3 / n)
        print(name, n, {k: round(v, 3) for k, v in row.items()}, flush=True)
    del ours
    torch.cuda.empty_cache()
try:
    run_vision_bench(VisionBenchJob(tower_lora=True, chunks=(1, 8, 32), out_dir=os.environ["OUT"] + "/vision"))
except Exception:
    traceback.print_exc()
