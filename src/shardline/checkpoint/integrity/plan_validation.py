"""shardline's DCP save planner: torch's plan and metadata, validated in O(n log n) per tensor.

Rank 0 checks the global save plan before anything is written: every chunk of every tensor in
bounds, no two chunks overlapping, and the chunks' volumes adding up to the tensor's. torch's
check (``default_planner._validate_global_plan``) finds overlaps with a sweep along each
tensor's largest dimension. shardline's FULL_SHARD layout splits dim 0, so for a tensor whose
largest dimension is another one (k/v projections, ``down_proj``, their Adam moments) every
chunk spans the whole sweep dimension and each chunk is compared with all the others: O(W^2)
per tensor (9.5 minutes on rank 0 at 4,096 ranks; docs/benchmarks.md).

Note: the sweep here runs along the dimension whose chunk offsets take the most distinct values
(the split dimension; ties go to the larger dimension). The sweep is exact along any dimension:
two boxes overlap only if their ranges overlap in every dimension, so a chunk that ended at or
before the current chunk's start along the sweep dimension can overlap neither it nor any chunk
after it, and is dropped. Along the split dimension few chunks are active at once (one for a
row split), so a row split is a sort and one pass; a 2-D grid of a x b blocks keeps at most
about b active. The checks and the messages are torch's (key and chunks named); the verdict is
the same as torch's on every plan (tests/checkpoint/test_plan_validation.py).
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right, insort
from collections.abc import Sequence

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from shardline._torch_compat import ValidatingSavePlanner

__all__ = ["ShardlineSavePlanner", "overlapping_pairs", "sweep_dimension", "validate_global_plan"]


def sweep_dimension(size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]) -> int:
    """The dimension to sweep ``chunks`` along: the one whose offsets vary most (ties: the larger dimension)."""
    dims = len(size)
    return max(range(dims), default=0, key=lambda d: (len({c.offsets[d] for c in chunks}), size[d]))


def _in_bounds(size: Sequence[int], chunk: ChunkStorageMetadata) -> bool:
    return all(o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, size, strict=False))


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def overlapping_pairs(
    chunks: Sequence[ChunkStorageMetadata], dim: int
) -> tuple[list[tuple[ChunkStorageMetadata, ChunkStorageMetadata]], int]:
    """The overlapping pairs of ``chunks`` (later in sweep order first) and the number of box comparisons made."""
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].offsets[dim], tuple(chunks[i].offsets)))
    active: list[tuple[int, int]] = []  # (end along dim, chunk index), sorted
    pairs = []
    compared = 0
    for i in order:
        current = chunks[i]
        start = current.offsets[dim]
        cutoff = bisect_right(active, (start, sys.maxsize))
        if cutoff:
            del active[:cutoff]
        for _, j in active:
            compared += 1
            if _overlap(current, chunks[j]):
                pairs.append((current, chunks[j]))
        insort(active, (start + current.sizes[dim], i))
    return pairs, compared


def validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """The problems of a global save plan (empty: valid): torch's checks and messages, in O(n log n) per tensor.

    Each tensor's chunks must lie inside the tensor, not overlap, and (with more than one local plan)
    have volumes adding up to the tensor's.
    """
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata) or len(value.size) == 0:
            continue
        chunks = value.chunks
        for chunk in chunks:
            if not _in_bounds(value.size, chunk):
                errors.append(f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {chunk}")
        if len(chunks) > 1:
            pairs, _ = overlapping_pairs(chunks, sweep_dimension(value.size, chunks))
            errors += [f"key:{key} has overlapping chunks: {a} {b}" for a, b in pairs]
        volume = sum(math.prod(c.sizes) for c in chunks)
        tensor_volume = math.prod(value.size)
        if len(global_plan) > 1 and volume != tensor_volume:
            errors.append(f"key:{key} invalid fill tensor-volume: {tensor_volume} chunks-volume: {volume}")
    return errors


class ShardlineSavePlanner(ValidatingSavePlanner):
    """torch DCP's default save planner with :func:`validate_global_plan` as its global-plan check."""

    def validate_global_plan(self, global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
        """See :func:`validate_global_plan`."""
        return validate_global_plan(global_plan, metadata)
