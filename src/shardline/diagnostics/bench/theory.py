"""The bytes per step each benchmarked configuration should move, from parameter shapes alone.

These are the formulas of ``docs/engine.md`` written out independently of the engine's layout
code: a parameter of ``R`` rows split over ``S`` ranks takes ``ceil(R/S)`` rows per rank.
"""

from __future__ import annotations

import math

from torch import nn

from shardline.engine import subtree_units
from shardline.models.gpt import GPT

__all__ = ["fsdp2_theory", "issued_on_gloo", "shardline_theory"]


def issued_on_gloo(theory: dict[str, int]) -> dict[str, int]:
    """What a c10d counter sees of shardline's theory on gloo: every collective issued as an all-reduce.

    shardline runs all-gathers and reduce-scatters on gloo as all-reduces of the same buffer
    (``shardline.engine.comm``), so the logical bytes are the same and the kind is all-reduce.
    """
    total = sum(theory.values())
    return {"all_reduce": total} if total else {}


def _padded(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """Elements one rank holds of each shape split on dim 0 over ``ranks`` (``torch.chunk`` rows, padded)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        total += math.ceil(rows / ranks) * (math.prod(shape) // max(rows, 1))
    return total


def shardline_theory(model: nn.Module) -> dict[str, int]:
    """Bytes per step of a shardline-sharded model, from its parameters' shapes (``docs/engine.md``).

    A parameter of ``R`` rows sharded over ``S`` ranks takes ``ceil(R/S)`` rows per rank
    (``torch.chunk``). Per unit and dtype group, with ``P_S`` the group's padded elements per
    rank: an all-gather of ``S*P_S`` in forward, again in backward for units that free after
    forward (over ``N`` ranks with ``reshard_after_forward=N``), a reduce-scatter of
    ``S*P_S_trainable`` and, with replicas, an all-reduce of ``P_S_trainable``. NO_SHARD
    all-reduces its trainable elements; SHARD_OPT all-reduces them and all-gathers ``S*P_S``
    (fp32 rows) in the forward after the optimizer step.
    """
    volume = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for unit in subtree_units(model):
        shard, replicas, policy = unit.mesh.shard_size, unit.mesh.replicate_size, unit.policy
        for group in unit.groups:
            members = group.params
            shapes = [sp.layout.shape for sp in members]
            trainable = [sp.layout.shape for sp in members if sp.sharded.requires_grad]
            rd = group.reduce_dtype.itemsize
            if policy.shard_optimizer and not policy.shard_params:  # SHARD_OPT
                if shard > 1:
                    volume["all_gather"] += shard * _padded(shapes, shard) * group.dtype.itemsize
                    volume["all_reduce"] += _padded(trainable, 1) * rd
                continue
            if policy.shard_params and shard > 1:
                cd = group.compute_dtype.itemsize
                volume["all_gather"] += shard * _padded(shapes, shard) * cd
                if unit.reshard_after_forward:
                    again = unit.post_forward_size or shard
                    volume["all_gather"] += again * _padded(shapes, again) * cd
                volume["reduce_scatter"] += shard * _padded(trainable, shard) * rd
                if replicas > 1:
                    volume["all_reduce"] += _padded(trainable, shard) * rd
            elif replicas > 1:
                volume["all_reduce"] += _padded(trainable, 1) * rd
    return {kind: n for kind, n in volume.items() if n}


def fsdp2_theory(model: GPT, world: int, *, shard: int | None = None) -> dict[str, int]:
    """Bytes per step of torch FSDP2 with ``fully_shard`` on every block and the root, from shapes.

    FSDP2 pads every parameter's dim 0 to a multiple of the shard size ``S`` (``world``, or the
    shard dimension of a 2-D mesh) and gathers a group's padded parameters in one all-gather:
    forward for every group, backward again for the blocks (the root keeps its parameters after
    forward), and reduce-scatters the padded gradients; with a 2-D mesh (HSDP) each rank then
    all-reduces its reduced shard across the replicas.
    """
    shard = shard or world
    blocks = [[tuple(p.shape) for p in block.parameters()] for block in model.blocks]
    in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]
    size = next(iter(model.parameters())).element_size()

    def padded(group: list[tuple[int, ...]]) -> int:
        return shard * _padded(group, shard) * size

    gather = 2 * sum(padded(g) for g in blocks) + padded(root)
    volume = {"all_gather": gather, "reduce_scatter": sum(padded(g) for g in blocks) + padded(root)}
    if shard < world:
        volume["all_reduce"] = volume["reduce_scatter"] // shard
    return volume
