"""The paged K/V cache tensors, sized from a memory budget.

    k, v: [num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim]

Block `num_blocks` (the last) is a scratch block the block manager never hands out: padded
rows of a CUDA-graph batch write their K/V there. On a GPU the number of blocks comes from
the memory left under `gpu_memory_fraction` after weights and the activation peak of a
profiling forward; on CPU it is configured.
"""

from __future__ import annotations

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_for_gpu_budget(device: torch.device, memory_fraction: float, block_bytes: int) -> int:
    """Blocks that fit in `memory_fraction` of the device memory beyond what this process's peak
    (weights + profiling activations, measured by the caller) already took."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must lie in (0, 1], got {memory_fraction}")
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    budget = total * memory_fraction - used_by_others - peak
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise RuntimeError(f"no memory left for the K/V cache: {total * memory_fraction / 2**30:.1f} GiB budget, "
                           f"{peak / 2**30:.1f} GiB peak of weights and activations, "
                           f"{used_by_others / 2**30:.1f} GiB used by other processes; raise gpu_memory_fraction "
                           "or lower max_tokens_per_step")
    return blocks


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks  # scratch block for padded rows

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bind(self, attention_layers) -> None:
        """Hands each attention layer its views of the cache."""
        if len(attention_layers) != self.k.shape[0]:
            raise ValueError(f"{len(attention_layers)} attention layers for a cache of {self.k.shape[0]}")
        for i, layer in enumerate(attention_layers):
            layer.k_cache, layer.v_cache = self.k[i], self.v[i]
