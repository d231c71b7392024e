"""Megatron-style tensor parallelism of the serving language model, over torch.distributed.

Each rank keeps a slice of every decoder layer (gpt-fast's / vLLM's split):

| projection    | split                    | this rank holds                          | after it               |
| ------------- | ------------------------ | ---------------------------------------- | ---------------------- |
| qkv_proj      | columns (output), per slice | heads h*r/w .. h*(r+1)/w of q, k and v | local attention heads  |
| o_proj        | rows (input)             | the columns of its q heads               | all-reduce (sum)       |
| gate_up_proj  | columns, per slice       | intermediate i*r/w .. i*(r+1)/w of both  | local SiLU-and-multiply|
| down_proj     | rows (input)             | the matching input columns               | all-reduce (sum)       |

Embeddings, norms and the LM head stay whole on every rank. The K/V cache holds the rank's own
K/V heads (the model's args become the local ones, so the runner sizes it per rank). The vision
tower is whole on every rank too (`SplitVision`), and `EngineConfig.tp_vision` says how it runs:
"split" shares out the work instead of the weights: each rank encodes its share of a step's
images and clips, and one all-gather hands every rank all the embeddings, so the tower's time
should fall with the ranks without touching its modules; "whole" has every rank encode every
item itself: no collective, the same embeddings on every rank by construction (the same weights,
inputs and kernels). Which is faster is measured (`vlora bench bench.suite=tp`, docs/scale_out.md).

The engine never holds the whole model on a rank: `load_model(..., tp=tp)` builds each decoder layer on
the meta device, cuts it there and only then allocates the shard (`allocated_shard`), and the loader
reads each projection's part alone (`shard_part`; from safetensors, only those bytes), so a rank's
peak memory is its shard plus the unsplit parts (a 72B model at TP=2: docs/scale_out.md).
`shard_model` splits a model already loaded whole into the same weights.

LoRA follows Punica's split, which needs no communication of its own: on a column-split
projection each rank holds all of A and its rows of B (x A^T is the same everywhere, B's rows
give the rank's columns); on a row-split one each rank holds its columns of A and all of B, so
x_r A_r^T B^T is the rank's partial sum of x A^T B^T and joins the base output's partial sum
before the one all-reduce. `tp_shard` on each projection tells the adapter loader which slice
of a PEFT checkpoint this rank takes (serve.lora.loader.cut_to_shard); merging an adapter into the weights then works per shard
(W_r += B_r A for columns, W_r += B A_r for rows) with the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .layers import Linear, RMSNorm

CONTROL_TIMEOUT = timedelta(days=365)  # how long a follower may wait for the leader's next call


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    group: object = None  # a torch.distributed process group; None: the default group
    # pickled control messages (the leader's calls, the policy's decisions) go over a gloo group of
    # their own: on NCCL each one would be copied to the GPU, broadcast and copied back, stalling
    # the host on the GPU's queue at every step; and a follower waits there for as long as the
    # server is idle, past any collective timeout fit for the model's all-reduces (torch's default,
    # 30 min, would end an idle group). None: over `group`
    control: object = None

    @classmethod
    def current(cls) -> "TPGroup":
        """The default group's ranks, with a gloo group of the same ranks for control messages
        (collective: every rank calls it, once, in the same order)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("tensor parallel needs torch.distributed initialised first "
                               "(torch.distributed.init_process_group, e.g. through torchrun)")
        # a leader that dies closes its connections, so a follower still learns of it at once
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size(), control=control)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def from_leader(self, obj=None):
        """Rank 0's `obj` on every rank (the others pass nothing): one pickled broadcast."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control if self.control is not None else self.group)
        return box[0]

    def all_gather_rows(self, local: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        """Every rank's `local` [rows[rank], ...], on every rank. Padded to the longest, since a
        collective moves equal shapes; `rows` must be the same list on every rank."""
        longest = max(rows)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[:local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return [part[:n] for part, n in zip(parts, rows)]

    def agreed_min(self, value: int, device) -> int:
        """The smallest `value` over the ranks (e.g. K/V cache blocks each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def check_divisible(args, world_size: int) -> None:
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(args, name) % world_size:
            raise ValueError(f"tensor parallel over {world_size} ranks needs {name} ({getattr(args, name)}) "
                             f"to be a multiple of {world_size}")


def _rows(t: torch.Tensor, parts: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """The rank's chunk of every slice of t's first dimension, slices back to back."""
    out, start = [], 0
    for size in parts:
        step = size // world
        out.append(t[start + rank * step:start + (rank + 1) * step])
        start += size
    return torch.cat(out)


def split_columns(linear: Linear, tp: TPGroup) -> Linear:
    """The rank's output columns of every slice (qkv_proj, gate_up_proj)."""
    w = tp.world_size
    local = Linear(linear.in_features, tuple(s // w for s in linear.output_slices), linear.slice_names,
                   bias=linear.bias is not None, dtype=linear.weight.dtype, device=linear.weight.device,
                   layer_index=linear.layer_index)
    local.weight.data.copy_(_rows(linear.weight.data, linear.output_slices, tp.rank, w))
    if linear.bias is not None:
        local.bias.data.copy_(_rows(linear.bias.data, linear.output_slices, tp.rank, w))
    local.tp_shard = ("out", tp.rank, w)
    return local


def split_rows(linear: Linear, tp: TPGroup) -> Linear:
    """The rank's input columns (o_proj, down_proj); a bias would be added once, after the sum."""
    if linear.bias is not None:
        raise ValueError(f"row-parallel {linear.slice_names}: a bias is not supported")
    w, step = tp.world_size, linear.in_features // tp.world_size
    local = Linear(step, linear.output_slices, linear.slice_names, dtype=linear.weight.dtype,
                   device=linear.weight.device, layer_index=linear.layer_index)
    local.weight.data.copy_(linear.weight.data[:, tp.rank * step:(tp.rank + 1) * step])
    local.tp_shard = ("in", tp.rank, w)
    return local


VISION_MODES = ("split", "whole")  # how the vision tower runs under tensor parallelism (SplitVision)


def check_vision_mode(mode: str) -> None:
    if mode not in VISION_MODES:
        raise ValueError(f"tp_vision={mode!r}: use split (each rank encodes its share of the items, then one "
                         "all-gather) or whole (every rank encodes every item, no collective)")


def local_args(args, world_size: int):
    """The model args of one rank: its share of the heads, K/V heads and intermediate size."""
    return replace(args, num_heads=args.num_heads // world_size, num_kv_heads=args.num_kv_heads // world_size,
                   intermediate_size=args.intermediate_size // world_size)


def check_shardable(args, tp: TPGroup, vision: str) -> None:
    """Raises ValueError (one line) before any layer is built or cut."""
    check_vision_mode(vision)
    check_divisible(args, tp.world_size)


def shard_layer(layer, tp: TPGroup, local) -> None:
    """Cuts one decoder layer to the rank's shard, in place (a loaded layer, or one on the meta device)."""
    attn, mlp = layer.attn, layer.mlp
    if any(hasattr(m, "base") for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        raise RuntimeError("shard_model must run before LoRA layers wrap the projections")
    attn.qkv_proj = split_columns(attn.qkv_proj, tp)
    attn.o_proj = split_rows(attn.o_proj, tp)
    mlp.gate_up_proj = split_columns(mlp.gate_up_proj, tp)
    mlp.down_proj = split_rows(mlp.down_proj, tp)
    attn.args = local
    attn.attn.num_heads, attn.attn.num_kv_heads = local.num_heads, local.num_kv_heads
    attn.reduce_output = mlp.reduce_output = tp.all_reduce


def allocated_shard(make_layer, tp: TPGroup, local, device):
    """A decoder layer holding only the rank's shard on `device`: built on the meta device (no memory),
    cut there, then allocated. Its weights are left for the loader; what a load may leave untouched
    starts as a fresh layer's would (biases 0, norms 1)."""
    layer = make_layer("meta")
    shard_layer(layer, tp, local)
    layer.to_empty(device=device)
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, Linear):
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif next(module.parameters(recurse=False), None) is not None or \
                    next(module.buffers(recurse=False), None) is not None:
                raise TypeError(f"{type(module).__name__} holds tensors that allocated_shard does not initialise")
    return layer


def finish_shard(model, tp: TPGroup, vision: str) -> None:
    """The model-wide part of a split: the local args, the vision tower shared out, the group."""
    local = local_args(model.args, tp.world_size)
    model.args = model.language_model.args = local
    model.vision = SplitVision(model.vision, tp, vision)
    model.tp = tp


def shard_model(model, tp: TPGroup, vision: str = "split") -> None:
    """Splits a loaded serve.models VisionLanguageModel across the ranks of `tp`, in place, before
    adapters are attached and before the engine sizes its K/V cache. vision: `VISION_MODES`.
    The engine builds the shard directly instead (`load_model(..., tp=tp)`, `allocated_shard`): the
    same weights, without ever holding the whole model."""
    check_shardable(model.args, tp, vision)  # before any layer is cut
    local = local_args(model.args, tp.world_size)
    for layer in model.language_model.layers:
        shard_layer(layer, tp, local)
    finish_shard(model, tp, vision)


def shard_part(t: torch.Tensor, shard: tuple[str, int, int]) -> torch.Tensor:
    """The rank's part of one checkpoint tensor of a sharded projection (a view): for an "out" shard
    (columns split) rows r*n/w .. (r+1)*n/w of one slice's weight or bias, as `split_columns` keeps
    of every slice; for an "in" shard (rows split) the same range of the last dimension."""
    return t.narrow(*part_range(t.shape, shard))


def part_range(shape, shard: tuple[str, int, int]) -> tuple[int, int, int]:
    """(dim, start, length) of the rank's part of a tensor of `shape` (shard_part; a file's slice too)."""
    axis, rank, world = shard
    dim = 0 if axis == "out" else len(shape) - 1
    if shape[dim] % world:
        raise ValueError(f"a tensor of shape {tuple(shape)} does not split into {world} equal parts along dim {dim}")
    step = shape[dim] // world
    return dim, rank * step, step


def assign_items(sizes: list[int], world_size: int) -> list[int]:
    """The rank of each item: largest first, each to the rank with the fewest tokens so far (ties to
    the lowest rank). Depends on `sizes` alone, so every rank computes the same assignment."""
    load, owner = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


class SplitVision(nn.Module):
    """A vision encoder (serve.models.vision) on every rank of a tensor-parallel group.

    mode "split": each rank runs the whole tower on its share of the step's items (balanced by
    tokens, `assign_items`), then one all-gather gives every rank every item's embedding rows, in
    the caller's order. A step with fewer items than ranks runs whole on every rank: splitting one
    clip would need the tower's own attention split. mode "whole": every rank encodes every item
    itself, with no collective (so the ranks need not reach the tower together)."""

    def __init__(self, inner: nn.Module, tp: TPGroup, mode: str = "split"):
        super().__init__()
        check_vision_mode(mode)
        self.inner, self.tp, self.mode = inner, tp, mode
        self.items_here = 0  # items this rank encoded itself (the rest came from its peers)

    def load(self, source) -> None:
        self.inner.load(source)

    def forward(self, items: list) -> list[torch.Tensor]:
        world = self.tp.world_size
        if self.mode == "whole" or len(items) < world:
            self.items_here += len(items)
            return self.inner(items)
        # with at least `world` items the first `world` go to distinct ranks: none is left empty
        owner = assign_items([it.num_tokens for it in items], world)
        mine = [it for it, rank in zip(items, owner) if rank == self.tp.rank]
        self.items_here += len(mine)
        rows = [sum(it.num_tokens for it, rank in zip(items, owner) if rank == r) for r in range(world)]
        parts = self.tp.all_gather_rows(torch.cat(self.inner(mine)), rows)
        out, taken = [], [0] * world
        for it, rank in zip(items, owner):
            out.append(parts[rank][taken[rank]:taken[rank] + it.num_tokens])
            taken[rank] += it.num_tokens
        return out

