"""Strategy keys written for torch FSDP or Lightning's FSDPStrategy that ``shardline train`` does not take.

Configs brought over from torch FSDP carry keys of its own. Two are accepted by the schema
(:class:`~shardline.train.schema.StrategyConfig`): ``use_orig_params`` (``true`` is what
shardline always does; ``false`` is refused there) and ``cpu_offload``. The others below cannot
be honoured as FSDP means them; each is refused with the reason and what to do instead, rather
than the generic "unknown key".
"""

from __future__ import annotations

__all__ = ["FOREIGN_STRATEGY_KEYS", "foreign_key_reason"]

FOREIGN_STRATEGY_KEYS: dict[str, str] = {
    "limit_all_gathers": (
        "shardline always bounds the gathers in flight (at most one prefetch per direction), so there is nothing "
        "to limit; remove the key"
    ),
    "sync_module_states": (
        "every rank of shardline train builds the model from the same trainer.seed (or materializes a meta model "
        "identically), so there is nothing to broadcast; remove the key (your own scripts can pass "
        "fully_shard(..., sync_module_states=True))"
    ),
    "forward_prefetch": (
        "prefetching is on by default and not a train setting; remove the key (your own scripts can pass "
        "fully_shard(..., forward_prefetch=...))"
    ),
    "backward_prefetch": (
        "shardline prefetches 'backward_pre' by default and it is not a train setting; remove the key (your own "
        "scripts can pass fully_shard(..., backward_prefetch=...))"
    ),
    "ignored_modules": (
        "shardline shards every parameter of a unit and has no unmanaged parameters inside a sharded model; "
        "freeze parameters with requires_grad=False instead, or leave a module out of the model"
    ),
    "param_init_fn": (
        "shardline initializes deferred modules with their own reset_parameters(); use trainer.init_device=meta"
    ),
    "device_id": "the device follows trainer.accelerator and each worker's local rank; remove the key",
    "offload_policy": "CPU offload is trainer.strategy.cpu_offload=true",
    "mp_policy": "mixed precision is trainer.strategy.mixed_precision (a shardline.MixedPrecision)",
}


def foreign_key_reason(key: str) -> str | None:
    """Why ``trainer.strategy.<key>`` is refused, when it is a torch FSDP / Lightning key shardline cannot honour."""
    reason = FOREIGN_STRATEGY_KEYS.get(key)
    if reason is None:
        return None
    return f"trainer.strategy.{key} is a torch FSDP setting shardline train does not take: {reason}."
