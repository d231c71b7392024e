"""Can the small model's features find the cars? detect_car on qwen2_vl_small after a short world
pretraining: LoRA + the dense head and each set head as fusion trains them, each set head alone on frozen features,
and a dense probe (one objectness + box per visual token, the cell holding a box centre) on the
same features.

    VLORA_HOME=$PWD/.vlora python -m bench.detect_probe --steps 600      # GPU: the GPU profile's settings
    VLORA_HOME=/tmp/probe python -m bench.detect_probe --tiny --steps 2  # CPU: the tiny model, 48 items

Needs the teachers in $VLORA_HOME/teachers (built by `vlora teachers` or any offline run).
Result on an H100: results/offline_gpu/detect_probe.log. An experiment, printed; nothing passes or fails.
"""
import argparse
import io, os, sys, time, json
import torch
import torch.nn.functional as F
import subprocess
from train.pretrain import PretrainConfig, pretrain
from train import LoraSpec, LoraTrainer, VisionLM
from train.model import ModelRef
from train.trainer import TrainConfig
from train.data import head_target, collate
from train.evaluate import hidden_states
from heads import HeadConfig, build_head, f1_at_iou
from zoo import build_checkpoint

ap = argparse.ArgumentParser(description="detect_car on the GPU profile's small model: heads and probes")
ap.add_argument("--steps", type=int, default=600, help="world pretraining steps")
ap.add_argument("--tiny", action="store_true", help="the tiny model on 48 items (a CPU check of the script)")
args = ap.parse_args()
SMALL = not args.tiny
home = os.environ.get("VLORA_HOME", ".vlora")
steps = args.steps
size = "{size: 1024, eval_fraction: 0.25}" if SMALL else "{size: 48, eval_fraction: 0.5}"
name = "qwen2_vl_small" if SMALL else "qwen2_vl_tiny"
ds_root = f"{home}/gpu/datasets"
t0 = time.time()  # the GPU profile's detect_car dataset (its own command, the floor above this one)
subprocess.run([sys.executable, "-m", "vlora", "distill", f"paths.home={home}/gpu", f"teachers.dir={home}/teachers",
                f"model={name}", "distill.only=[detect_car]", f"distill.domains.detect_car={size}"], check=True)
print(f"distill {time.time() - t0:.0f} s", flush=True)
base = build_checkpoint(name, f"{home}/gpu/zoo/{name}")
t0 = time.time()
pcfg = PretrainConfig(steps=steps, batch_size=32 if SMALL else 2, lr=1e-3, warmup_steps=50 if SMALL else 1,
                      mixed_precision="bf16" if SMALL else "no", workers=14 if SMALL else 0)
out = pretrain(base, f"{home}/gpu/zoo/{name}_pre{steps}", pcfg, log=io.StringIO())
rec = json.loads(open(f"{out}/pretrain.json").read())
print(f"pretrain {steps} steps {time.time() - t0:.0f} s, last losses {rec['loss_last'][-2:]}", flush=True)
ref = ModelRef(name=name, path=str(out), arch="qwen2_vl", dtype="float32")
vlm = VisionLM(ref, LoraSpec(), mixed_precision="bf16" if SMALL else "no")
dev = vlm.device
trainer = LoraTrainer(vlm, ds_root, TrainConfig(epochs=4, batch_size=16, lr=1e-3, head_lr=1e-2, eval_batch_size=32))
data = trainer.dataset("detect_car")
print("teacher vs truth", json.loads(open(f"{ds_root}/detect_car/domain.json").read())["teacher_vs_truth"], flush=True)

# 1) LoRA + head as fusion trains it, per pooling (dense: detect's default, a box per visual token)
for pooling in ("dense", "slots", "attention"):
    trainer.head_overrides = {"pooling": pooling}
    t0 = time.time()
    state = trainer.train(trainer.new_adapter(1), "detect_car")
    print(f"LoRA + {pooling} head, 4 epochs: eval f1@0.5 {trainer.evaluate(state, 'detect_car'):.3f} ({time.time() - t0:.0f} s)", flush=True)

# 2) frozen base features: heads and a dense per-token probe
vlm.reset_lora(0)
def feats(split):
    rows = [data.splits[split][i] for i in range(data.size(split))]
    H, M, V = [], [], []
    for s in range(0, len(rows), 32):
        items = vlm.encoder.encode_many(rows[s:s + 32], data.info)
        h, m = hidden_states(vlm, items)
        vm = collate(items, vlm.encoder.pad_id)["visual_mask"]
        H += list(h.float()); M += list(m); V += list(vm.to(h.device))
    L = max(x.shape[0] for x in H)
    pad = lambda xs, fill: torch.stack([torch.cat([x, x.new_full((L - x.shape[0],) + x.shape[1:], fill)]) for x in xs])
    return pad(H, 0.0), pad(M, 0), pad(V, False), [head_target(data.info, r) for r in rows]
tr, ev = feats("train"), feats("eval")
n_tr, D = tr[0].shape[0], tr[0].shape[-1]
print("features", tuple(tr[0].shape), flush=True)
def f1_head(head, X, th=0.5):
    with torch.no_grad():
        out = head(X[0], X[1])
    return round(f1_at_iou([r.boxes for r in head.decode(out, threshold=th)], X[3], 0.5), 3)
for pooling in ("slots", "attention"):
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="detect", hidden_size=D, max_boxes=6, pooling=pooling)).to(dev)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    targets = head.targets_from(tr[3], dev)
    for step in range(1500):
        idx = torch.randint(0, n_tr, (32,), device=dev)
        loss = head.loss(head(tr[0][idx], tr[1][idx]), {k: v[idx] for k, v in targets.items()})
        opt.zero_grad(); loss.backward(); opt.step()
    head.eval()
    print(f"frozen features, {pooling} head only: loss {loss.item():.3f} train f1 {f1_head(head, tr)} eval f1 {f1_head(head, ev)} "
          f"(eval at 0.3: {f1_head(head, ev, 0.3)})", flush=True)
def visual_rows(X):
    h, m, vm, T = X
    rows = torch.stack([h[i][vm[i]] for i in range(h.shape[0])])  # [N, V, D]
    return rows, T
Vtr, Ttr = visual_rows(tr); Vev, Tev = visual_rows(ev)
G = int(round(Vtr.shape[1] ** 0.5))
def dense_targets(T):
    obj = torch.zeros(len(T), G * G, device=dev); box = torch.zeros(len(T), G * G, 4, device=dev)
    for b, boxes in enumerate(T):
        for x1, y1, x2, y2 in boxes:
            c = min(int((y1 + y2) / 2 * G), G - 1) * G + min(int((x1 + x2) / 2 * G), G - 1)
            obj[b, c] = 1; box[b, c] = torch.tensor([x1, y1, x2, y2], device=dev)
    return obj, box
otr, btr = dense_targets(Ttr)
for hidden in (0, 512):
    torch.manual_seed(0)
    net = (torch.nn.Linear(D, 5) if hidden == 0 else torch.nn.Sequential(torch.nn.Linear(D, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 5))).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(2000):
        idx = torch.randint(0, n_tr, (32,), device=dev)
        out = net(Vtr[idx])
        held = otr[idx] > 0
        loss = F.binary_cross_entropy_with_logits(out[..., 0], otr[idx], pos_weight=torch.tensor(10.0, device=dev)) \
            + 5 * ((out[..., 1:].sigmoid() - btr[idx]).abs().sum(-1) * held).sum() / held.sum().clamp(min=1)
        opt.zero_grad(); loss.backward(); opt.step()
    def f1(V, T, thr):
        with torch.no_grad():
            out = net(V)
        preds = [[tuple(out[b, c, 1:].sigmoid().tolist()) for c in (out[b, :, 0].sigmoid() > thr).nonzero().flatten().tolist()]
                 for b in range(V.shape[0])]
        return round(f1_at_iou(preds, T, 0.5), 3)
    print(f"frozen features, dense {'linear' if hidden == 0 else 'mlp'} probe on {G}x{G} visual tokens: "
          f"train f1 {[f1(Vtr, Ttr, t) for t in (0.5, 0.8)]} eval f1 {[f1(Vev, Tev, t) for t in (0.5, 0.8)]}", flush=True)
