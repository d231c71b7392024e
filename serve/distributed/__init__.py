"""Scale-out: tensor parallelism inside one engine replica (torch.distributed: NCCL on GPUs, gloo on CPU).

    from serve.distributed import TPGroup, shard_model
    shard_model(model, TPGroup.current())      # or EngineConfig(tensor_parallel_size=2) on every rank
"""

from .tensor_parallel import TPGroup, check_divisible, shard_model, split_columns, split_rows

__all__ = ["TPGroup", "check_divisible", "shard_model", "split_columns", "split_rows"]
