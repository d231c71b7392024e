"""ATMM: adaptive-tiling batched LoRA Triton kernels, their tiling tables and the one-shot merge kernel."""
