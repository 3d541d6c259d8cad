"""What checkpoint code needs from the engine beyond its public API: managed-parameter handles and host copies.

Note: these are the engine's internals (its parameter handles, the registered-tensor walk, host copies that fail
with ``HOST_OOM``), shared with ``shardline.checkpoint`` only. They live here, not in ``shardline.engine.__all__``,
so the engine's public face stays the sharding API; user code should not import this module.
"""

from shardline.engine.state_dict import (
    HOST_OOM,
    ManagedParam,
    buffer_original_dtypes,
    gather_full_tensors,
    host_copy,
    key_problems,
    managed_parameters,
    plain_state_dict,
    registered_state_dict,
    release_all,
)

__all__ = [
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
]
