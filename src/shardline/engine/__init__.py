"""The sharding engine: ``fully_shard`` and everything it needs.

Code outside the engine (checkpoints, training, diagnostics) uses only the names exported here.
"""

from shardline.engine.accounting import (
    comm_stats,
    count_collectives,
    memory_stats,
    reset_comm_stats,
    reset_peak_memory_stats,
    use_collectives,
)
from shardline.engine.activation import apply_activation_checkpointing, is_checkpointed
from shardline.engine.api import ShardedModule, fully_shard, original_class
from shardline.engine.comm import (
    CollectiveKind,
    CollectiveRecord,
    Collectives,
    CommCounter,
    CommStats,
    TorchCollectives,
    Work,
)
from shardline.engine.grad import clip_grad_norm_
from shardline.engine.guards import ddp_ignored_names
from shardline.engine.init import materialize
from shardline.engine.layout import FlatLayout, ParamLayout
from shardline.engine.memory import MemoryStats
from shardline.engine.mesh import hybrid_degrees, hybrid_mesh
from shardline.engine.mixed_precision import MixedPrecision
from shardline.engine.registry import subtree_units
from shardline.engine.state_dict import (
    HOST_OOM,
    ManagedParam,
    buffer_original_dtypes,
    full_state_dict,
    gather_full_tensors,
    host_copy,
    key_problems,
    load_full_state_dict,
    managed_parameters,
    plain_state_dict,
    registered_state_dict,
    release_all,
)
from shardline.engine.strategy import ShardingStrategy, StrategyPolicy
from shardline.engine.traversal import post_order
from shardline.engine.unit import Residency, ShardUnit
from shardline.engine.wrapping import LayerPolicy, check_policy_matches, layer_policy, resolve_class, wrap

__all__ = [
    "HOST_OOM",
    "CollectiveKind",
    "CollectiveRecord",
    "Collectives",
    "CommCounter",
    "CommStats",
    "FlatLayout",
    "LayerPolicy",
    "ManagedParam",
    "MemoryStats",
    "MixedPrecision",
    "ParamLayout",
    "Residency",
    "ShardUnit",
    "ShardedModule",
    "ShardingStrategy",
    "StrategyPolicy",
    "TorchCollectives",
    "Work",
    "apply_activation_checkpointing",
    "buffer_original_dtypes",
    "check_policy_matches",
    "clip_grad_norm_",
    "comm_stats",
    "count_collectives",
    "ddp_ignored_names",
    "full_state_dict",
    "fully_shard",
    "gather_full_tensors",
    "host_copy",
    "hybrid_degrees",
    "hybrid_mesh",
    "is_checkpointed",
    "key_problems",
    "layer_policy",
    "load_full_state_dict",
    "managed_parameters",
    "materialize",
    "memory_stats",
    "original_class",
    "plain_state_dict",
    "post_order",
    "registered_state_dict",
    "release_all",
    "reset_comm_stats",
    "reset_peak_memory_stats",
    "resolve_class",
    "subtree_units",
    "use_collectives",
    "wrap",
]
