"""Scale-out: tensor parallelism inside one engine replica (torch.distributed: NCCL on GPUs, gloo on CPU).

Every rank builds the same engine with `EngineConfig(tensor_parallel_size=N)` after
`torch.distributed.init_process_group`; the engine splits its language model (`shard_model`),
rank 0 serves through `LeaderEngine` and the other ranks run `follow(engine)`. `LocalGroup`
does all of that from one process (it leads and starts the other ranks); replicas on Ray Serve
are in serve.distributed.replicas (imported on its own: Ray is optional).
"""

from .driver import LeaderEngine, follow
from .local_group import LocalGroup
from .tensor_parallel import (TPGroup, check_divisible, free_port, join_group, leave_group, shard_model, split_columns,
                              split_rows)

__all__ = ["TPGroup", "check_divisible", "free_port", "join_group", "leave_group", "shard_model", "split_columns",
           "split_rows", "LeaderEngine", "LocalGroup", "follow"]
