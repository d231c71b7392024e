"""serve's lowest floor: what every layer of one forward pass shares.

`context.py` holds the step's metadata (paged-cache layout, the step's LoraBatch) that the
model runner sets before a forward; `attention.py` is paged attention over the K/V cache, with
the Triton kernels in `prefill_kernel.py` / `decode_kernel.py` and a PyTorch path. The models
(serve/models) and the LoRA layers (serve/lora) import from here; nothing here imports them.
"""

from .attention import PagedAttention, paged_attention_torch, store_kv
from .context import StepContext, get_context, peek_context, set_context, step_context
from .decode_kernel import paged_decode
from .prefill_kernel import paged_prefill

__all__ = ["PagedAttention", "paged_attention_torch", "store_kv", "StepContext", "get_context", "peek_context",
           "set_context", "step_context", "paged_decode", "paged_prefill"]
