"""Offline stage: teachers (small models) distilled into datasets, and LoRA + task-head training."""
