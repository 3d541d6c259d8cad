"""The search: every configuration worth trying, its memory and time, the ones that fit, fastest first.

Tried: NO_SHARD, SHARD_OPT (ZeRO-1), SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3), FULL_SHARD
with ``reshard_after_forward`` set to the node size (parameters kept split within a node after
forward, so backward re-gathers over NVLink only) when the job spans nodes, and the two hybrid
strategies for every shard size that is a multiple of the node size and a proper divisor of the
world (one node when the job is one node's worth of smaller groups: every divisor); each with
every micro-batch that divides a rank's share of the global batch and activation checkpointing
none / selective / full. Memory comes from the estimator (:mod:`.memory`), so the same
configuration predicts the same bytes in ``shardline estimate``.
"""

from __future__ import annotations

import dataclasses

from shardline.diagnostics.plan.architecture import ActivationCheckpointing, Architecture
from shardline.diagnostics.plan.cost import (
    USABLE_MEMORY_FRACTION,
    Candidate,
    Cluster,
    Prediction,
    Training,
    accumulation_steps,
    predict,
)
from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError

__all__ = ["candidates", "search"]

_FLAT = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.SHARD_OPT,
    ShardingStrategy.NO_SHARD,
)
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def _sharding(cluster: Cluster) -> list[tuple[ShardingStrategy, int | None, bool | int | None]]:
    world, node = cluster.world_size, cluster.gpus_per_node
    out: list[tuple[ShardingStrategy, int | None, bool | int | None]] = [(s, None, None) for s in _FLAT]
    if cluster.nodes > 1 and 1 < node < world:
        out.append((ShardingStrategy.FULL_SHARD, None, node))
    step = node if cluster.nodes > 1 else 1
    for shard in range(max(2, step), world, step):
        if world % shard == 0:
            out.extend((s, shard, None) for s in _HYBRID)
    return out


def candidates(cluster: Cluster, training: Training, *, micro_batches: tuple[int, ...] = ()) -> list[Candidate]:
    """Every configuration the search tries (``micro_batches``: only these; default every divisor)."""
    local = accumulation_steps(cluster, training, 1)  # one line when the world size does not divide the batch
    sizes = micro_batches or tuple(m for m in range(1, local + 1) if local % m == 0)
    return [
        Candidate(strategy=s, shard_size=shard, reshard_after_forward=raf, micro_batch=m, ac=ac)
        for s, shard, raf in _sharding(cluster)
        for m in sizes
        for ac in ActivationCheckpointing
    ]


def search(
    arch: Architecture,
    *,
    cluster: Cluster,
    training: Training,
    strategies: tuple[ShardingStrategy, ...] = (),
    micro_batches: tuple[int, ...] = (),
    acs: tuple[ActivationCheckpointing, ...] = (),
) -> list[Prediction]:
    """Predictions for every candidate that fits in memory, highest tokens/s per GPU first.

    ``strategies``, ``micro_batches`` and ``acs`` restrict the search (empty: all). Raises
    :class:`~shardline.errors.ConfigurationError` naming what would fit when nothing does.
    """
    pool = [
        c
        for c in candidates(cluster, training, micro_batches=micro_batches)
        if (not strategies or c.strategy in strategies) and (not acs or c.ac in acs)
    ]
    predictions = [predict(arch, cluster=cluster, training=training, candidate=c) for c in pool]
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        raise ConfigurationError(_nothing_fits(arch, cluster, training, predictions))
    return sorted(fitting, key=lambda p: -p.tokens_per_s_per_gpu)


def _nothing_fits(arch: Architecture, cluster: Cluster, training: Training, tried: list[Prediction]) -> str:
    device = cluster.device
    usable = device.memory_gib * USABLE_MEMORY_FRACTION
    least = min(tried, key=lambda p: p.peak_memory_gib) if tried else None
    head = f"nothing fits in {usable:.1f} GiB usable of {device.memory_gib:g} GiB per device"
    if least is not None:
        head += f" (the smallest is {least.peak_memory_gib:.1f} GiB: {least.candidate.label})"
    # The leanest configuration: FULL_SHARD, full checkpointing, one sequence per micro-batch; more
    # ranks shrink its sharded state. Double the world until it fits.
    lean = Candidate(strategy=ShardingStrategy.FULL_SHARD, micro_batch=1, ac=ActivationCheckpointing.FULL)
    world = cluster.world_size
    while world < 2**16:
        world *= 2
        nodes = max(1, world // cluster.gpus_per_node)
        bigger = dataclasses.replace(cluster, nodes=nodes, gpus_per_node=min(world, cluster.gpus_per_node))
        p = predict(arch, cluster=bigger, training=dataclasses.replace(training, global_batch=world),
                    candidate=lean)  # fmt: skip
        if p.fits:
            return f"{head}; needs >= {world} devices at FULL_SHARD with full AC and micro-batch 1"
    activations = arch.n_layers * training.seq_len
    return (
        f"{head}; even one sequence's activations ({training.seq_len} tokens x {arch.n_layers} layers = "
        f"{activations:,} token-layers) do not fit at any world size: shorten --seq-len"
    )
