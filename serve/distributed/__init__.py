"""Scale-out: what starts and drives tensor-parallel engines and engine replicas.

Every rank builds the same engine with `EngineConfig(tensor_parallel_size=N)` after joining the
process group (`join_group`); the engine splits its language model itself (serve.models.parallel,
re-exported here: `TPGroup`, `shard_model`), rank 0 serves through `LeaderEngine` and the other
ranks run `follow(engine)`. `LocalGroup` does all of that from one process (it leads and starts
the other ranks); replicas on Ray Serve are in serve.distributed.replicas (imported on its own:
Ray is optional).
"""

from serve.models.parallel import TPGroup, check_divisible, shard_model, split_columns, split_rows

from .driver import LeaderEngine, follow
from .group import free_port, join_group, leave_group
from .local_group import LocalGroup

__all__ = ["TPGroup", "check_divisible", "free_port", "join_group", "leave_group", "shard_model", "split_columns",
           "split_rows", "LeaderEngine", "LocalGroup", "follow"]
