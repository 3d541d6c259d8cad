"""The sharding engine: ``fully_shard`` and everything it needs."""

from shardline.engine.activation import apply_activation_checkpointing
from shardline.engine.api import ShardedModule, fully_shard
from shardline.engine.comm import (
    CollectiveKind,
    CollectiveRecord,
    CommCounter,
    CommStats,
    comm_stats,
    count_collectives,
    reset_comm_stats,
)
from shardline.engine.grad import clip_grad_norm_
from shardline.engine.init import materialize
from shardline.engine.memory import MemoryStats, memory_stats, reset_peak_memory_stats
from shardline.engine.mixed_precision import MixedPrecision
from shardline.engine.state_dict import full_state_dict, load_full_state_dict
from shardline.engine.strategy import ShardingStrategy, StrategyPolicy
from shardline.engine.unit import ShardUnit
from shardline.engine.wrap import LayerPolicy, layer_policy, wrap

__all__ = [
    "CollectiveKind",
    "CollectiveRecord",
    "CommCounter",
    "CommStats",
    "LayerPolicy",
    "MemoryStats",
    "MixedPrecision",
    "ShardUnit",
    "ShardedModule",
    "ShardingStrategy",
    "StrategyPolicy",
    "apply_activation_checkpointing",
    "clip_grad_norm_",
    "comm_stats",
    "count_collectives",
    "full_state_dict",
    "fully_shard",
    "layer_policy",
    "load_full_state_dict",
    "materialize",
    "memory_stats",
    "reset_comm_stats",
    "reset_peak_memory_stats",
    "wrap",
]
