"""Our Qwen2-VL / Qwen2.5-VL vision transformer: the checkpoint's weights, one step in one pass.

Same parameters and names as the transformers towers (`patch_embed.proj`, `blocks.N.{norm1,
norm2, attn.qkv, attn.proj, mlp.*}`, `merger.{ln_q, mlp.0, mlp.2}`), so the checkpoint loads
as is; the forward differs where it costs:
- every image and frame group of a step in one packed pass, one attention launch per layer
  (`serve.forward.segments`), where transformers launches one attention per frame per layer;
- rotary positions, segments and Qwen2.5-VL's window order come from the host layout
  (`qwen_layout`), nothing is read back from the device;
- the 3D patch convolution is the matmul it is (stride = kernel), fused norms.
Parity with transformers is tested on the tiny zoo (fp32) and at full shape on a GPU (bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..forward.segments import segment_attention
from .qwen_layout import QwenLayout, qwen_layout


def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def activation(name: str):
    """The vision towers' hidden_act by name (Qwen and CLIP configs)."""
    if name == "quick_gelu":
        return _quick_gelu
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh" if name.endswith("tanh") else "none")
    raise ValueError(f"vision tower activation {name!r} is not supported")


def _rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q and k of qkv [rows, 3, heads, dim] rotated in fp32 as the reference does -> [rows, 2, heads, dim]."""
    qk = qkv[:, :2].float()
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return (qk * cos + rotated * sin).to(qkv.dtype)


def _silu_mul(gate, up):
    return F.silu(gate) * up


# With `QwenVisionTower.compiled` on a GPU, the elementwise chains (rotary in fp32, activations) run
# as one kernel each instead of five to eight eager ones: our Triton kernels for the rotary and
# quick_gelu (`vision_fused`; the rotary that torch.compile generated for a dynamic row count ran at
# a seventeenth of its bandwidth), torch.compile (dynamic shapes) for the rest.
_COMPILED: dict = {}


def _triton_kernels() -> dict:
    from .vision_fused import quick_gelu, rotary_qk

    return {_rotary_qk: rotary_qk, _quick_gelu: quick_gelu}


def _fused(on: bool, fn, *args):
    if not (on and args[0].is_cuda):
        return fn(*args)
    kernel = _COMPILED.get(fn)
    if kernel is None:
        kernel = _COMPILED[fn] = _triton_kernels().get(fn) or torch.compile(fn, dynamic=True)
    return kernel(*args)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(dim: int, rms: bool) -> nn.Module:
    return _RMSNorm(dim, 1e-6) if rms else nn.LayerNorm(dim, eps=1e-6)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, segments, mode, compiled=False):
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.heads, -1)
        qk = _fused(compiled, _rotary_qk, qkv, cos, sin)
        out = segment_attention(qk[:, 0], qk[:, 1], qkv[:, 2], segments, mode)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):  # Qwen2-VL, and CLIP (the same fc1 -> act -> fc2)
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), activation(act)

    def forward(self, x, compiled=False):
        h = self.fc1(x)
        return self.fc2(_fused(compiled, self.act, h) if self.act is _quick_gelu else self.act(h))


class _GatedMLP(nn.Module):  # Qwen2.5-VL
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj, self.act = nn.Linear(hidden, dim), activation(act)

    def forward(self, x, compiled=False):
        return self.down_proj(_fused(compiled, _silu_mul, self.gate_proj(x), self.up_proj(x)) if self.act is F.silu
                              else self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, dim, heads, hidden, act, gated: bool):
        super().__init__()
        self.norm1, self.norm2 = _norm(dim, gated), _norm(dim, gated)
        self.attn = _Attention(dim, heads)
        self.mlp = (_GatedMLP if gated else VisionMLP)(dim, hidden, act)

    def forward(self, x, cos, sin, segments, mode, compiled=False):
        x = x + self.attn(self.norm1(x), cos, sin, segments, mode, compiled)
        return x + self.mlp(self.norm2(x), compiled)


class _PatchEmbed(nn.Module):
    def __init__(self, channels, temporal, patch, dim):
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels):  # [rows, C * T * P * P]: a convolution whose stride is its kernel
        return F.linear(pixels.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class _Merger(nn.Module):
    def __init__(self, out_dim, dim, merge, rms: bool):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = _norm(dim, rms)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    """Built from the checkpoint's `vision_config`; `arch` is "qwen2_vl" or "qwen2_5_vl"."""

    def __init__(self, vc, arch: str):
        super().__init__()
        gated = arch == "qwen2_5_vl"
        dim = vc.hidden_size if gated else vc.embed_dim
        out_dim = vc.out_hidden_size if gated else vc.hidden_size
        hidden = vc.intermediate_size if gated else int(vc.embed_dim * vc.mlp_ratio)
        self.heads, self.merge, self.patch = vc.num_heads, vc.spatial_merge_size, vc.patch_size
        channels = getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)
        self.patch_embed = _PatchEmbed(channels, vc.temporal_patch_size, vc.patch_size, dim)
        self.blocks = nn.ModuleList(_Block(dim, vc.num_heads, hidden, vc.hidden_act, gated) for _ in range(vc.depth))
        self.merger = _Merger(out_dim, dim, vc.spatial_merge_size, gated)
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size if gated else None
        self.full_layers = set(getattr(vc, "fullatt_block_indexes", []) or []) if gated else None
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = dim // vc.num_heads // 2  # h and w each rotate a quarter of the head's pairs
        # a plain attribute, not a buffer: it must stay fp32 when the tower is cast to bf16
        self.inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        self.attention = "auto"  # segment attention mode (serve.forward.segments.MODES)
        # compiled elementwise kernels on a GPU (the engine turns them on and calls `warm_up` at start,
        # so no step pays the compile)
        self.compiled = False

    @torch.no_grad()
    def warm_up(self) -> float:
        """Compiles the elementwise kernels now (when `compiled` on a GPU), on two packed sizes so the
        row count is traced as dynamic: serving's first steps then pay no compile. Returns seconds."""
        import time

        weight = self.patch_embed.proj.weight
        if not (self.compiled and weight.is_cuda):
            return 0.0
        start = time.perf_counter()
        side = 4 * self.merge * (self.window or 1)
        for count in (2, 3):
            grids = [(1, side, side)] * count
            self(torch.zeros(count * side * side, weight[0].numel(), device=weight.device, dtype=weight.dtype),
                 self.layout(grids))
        torch.cuda.synchronize(weight.device)
        return time.perf_counter() - start

    def layout(self, grids: list[tuple[int, int, int]]) -> QwenLayout:
        return qwen_layout(grids, self.merge, self.patch_embed.proj.weight.device, self.window)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows, 1, 1, head_dim] (fp32) of each row's (row, col) patch position (broadcast over
        q/k and heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = (positions.float()[:, :, None] * self.inv_freq).flatten(1)  # [rows, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, layout: QwenLayout) -> torch.Tensor:
        """pixels: [rows, C * T * P * P] of the items in order -> [rows / merge^2, out_dim]."""
        if layout.order is not None:
            pixels = pixels.index_select(0, layout.order)
        x = self.patch_embed(pixels)
        cos, sin = self.rotary(layout.positions)
        for i, block in enumerate(self.blocks):
            windowed = layout.windows is not None and i not in self.full_layers
            x = block(x, cos, sin, layout.windows if windowed else layout.frames, self.attention, self.compiled)
        out = self.merger(x)
        return out if layout.restore is None else out.index_select(0, layout.restore)
