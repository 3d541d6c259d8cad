"""The sharding engine: ``fully_shard`` and everything it needs.

Code outside the engine (training, diagnostics) uses only the names exported here; checkpoint code also uses
``shardline.engine._checkpoint_support`` (managed-parameter handles, host copies), which is not public.
"""

from shardline._deprecation import moved_names
from shardline.engine.accounting import (
    comm_stats,
    count_collectives,
    memory_stats,
    reset_comm_stats,
    reset_peak_memory_stats,
    transfer_stats,
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
from shardline.engine.grad_scaler import LossScaling, ShardedGradScaler
from shardline.engine.guards import ddp_ignored_names
from shardline.engine.init import materialize
from shardline.engine.layout import FlatLayout, ParamLayout
from shardline.engine.memory import MemoryStats
from shardline.engine.mesh import hybrid_degrees, hybrid_mesh
from shardline.engine.mixed_precision import MixedPrecision
from shardline.engine.offload import CPUOffload, OffloadPolicy, TransferStats
from shardline.engine.registry import subtree_units
from shardline.engine.state_dict import full_state_dict, load_full_state_dict
from shardline.engine.strategy import ShardingStrategy, StrategyPolicy
from shardline.engine.traversal import post_order
from shardline.engine.unit import Residency, ShardUnit
from shardline.engine.wrapping import LayerPolicy, check_policy_matches, layer_policy, resolve_class, wrap

__all__ = [
    "CPUOffload",
    "CollectiveKind",
    "CollectiveRecord",
    "Collectives",
    "CommCounter",
    "CommStats",
    "FlatLayout",
    "LayerPolicy",
    "LossScaling",
    "MemoryStats",
    "MixedPrecision",
    "OffloadPolicy",
    "ParamLayout",
    "Residency",
    "ShardUnit",
    "ShardedGradScaler",
    "ShardedModule",
    "ShardingStrategy",
    "StrategyPolicy",
    "TorchCollectives",
    "TransferStats",
    "Work",
    "apply_activation_checkpointing",
    "check_policy_matches",
    "clip_grad_norm_",
    "comm_stats",
    "count_collectives",
    "ddp_ignored_names",
    "full_state_dict",
    "fully_shard",
    "hybrid_degrees",
    "hybrid_mesh",
    "is_checkpointed",
    "layer_policy",
    "load_full_state_dict",
    "materialize",
    "memory_stats",
    "original_class",
    "post_order",
    "reset_comm_stats",
    "reset_peak_memory_stats",
    "resolve_class",
    "subtree_units",
    "transfer_stats",
    "use_collectives",
    "wrap",
]

_INTERNAL = "shardline.engine._checkpoint_support"
__getattr__ = moved_names(
    __name__,
    dict.fromkeys(
        [
            "HOST_OOM",
            "ManagedParam",
            "buffer_original_dtypes",
            "gather_full_tensors",
            "host_copy",
            "key_problems",
            "managed_parameters",
            "plain_state_dict",
            "registered_state_dict",
            "release_all",
        ],
        _INTERNAL,
    ),
    private=True,
)
