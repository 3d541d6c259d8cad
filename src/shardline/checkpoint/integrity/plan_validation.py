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

import dataclasses
import io
import math
import sys
from bisect import bisect_right, insort
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from shardline._torch_compat import ValidatingSavePlanner
from shardline.checkpoint.coordination.parallelism import resolve_files_per_rank
from shardline.checkpoint.format.packed_layout import DEFAULT_SEGMENT_BYTES, PACKED_LAYOUT_KEY, CheckpointLayout
from shardline.checkpoint.integrity.chunk_count import warn_if_many_chunks
from shardline.checkpoint.integrity.packed_plan import PLAN_DIGEST_KEY, PackedSave, check_packed_plan, table_digest
from shardline.errors import ConfigurationError

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
    """torch DCP's default save planner with :func:`validate_global_plan` as its global-plan check.

    ``layout="packed"`` stores every packable DTensor (``Replicate`` and at most one ``Shard(0)``) in
    this rank's segments instead of one chunk per tensor (:mod:`..format.packed_layout`,
    :mod:`.packed_plan`): rank 0 records the layout table in the metadata's ``planner_data`` and its
    plan check fails the save when a rank's table or segments differ from it. Segments are cut at
    ``segment_bytes``, or smaller so that they spread over the ``files_per_rank`` files the storage
    writer writes per rank (0: automatic, up to 8 of at least 16 MiB each; :mod:`.packed_spread`);
    give every rank the same value. ``per_tensor`` (the default) plans exactly what torch's default planner plans.
    """

    def __init__(
        self,
        *,
        layout: CheckpointLayout | str = CheckpointLayout.PER_TENSOR,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        files_per_rank: int = 1,
    ) -> None:
        super().__init__()
        self.layout = CheckpointLayout.parse(layout)
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes <= 0:
            raise ConfigurationError(f"segment_bytes must be a positive number of bytes, got {segment_bytes!r}")
        resolve_files_per_rank(files_per_rank)
        self.segment_bytes = segment_bytes
        self.files_per_rank = files_per_rank
        self.packed: PackedSave | None = None
        """This rank's packed part, once the local plan is made (packed layout only)."""

    def create_local_plan(self) -> SavePlan:
        """torch's local plan; in the packed layout with the packable DTensors' chunks replaced by segment items."""
        if self.layout is CheckpointLayout.PER_TENSOR:
            return super().create_local_plan()
        initialized = dist.is_available() and dist.is_initialized()
        self.packed = PackedSave.build(
            self.state_dict,
            rank=dist.get_rank() if initialized else 0,
            world_size=dist.get_world_size() if initialized else 1,
            segment_bytes=self.segment_bytes,
            files_per_rank=self.files_per_rank,
        )
        packed_keys = self.packed.packed_keys
        rest = {k: v for k, v in self.state_dict.items() if k not in packed_keys}
        plan = create_default_local_save_plan(rest, self.is_coordinator)
        self.plan = dataclasses.replace(
            plan,
            items=[*plan.items, *self.packed.write_items()],
            planner_data={**self.mappings, PLAN_DIGEST_KEY: table_digest(self.packed.layout)},
        )
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """A segment's concatenated pieces (built now), or what torch resolves for any other item."""
        if self.packed is not None and write_item.index.fqn in self.packed.segments:
            return self.packed.segment_data(write_item.index.fqn)
        return super().resolve_data(write_item)

    def validate_global_plan(self, global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
        """See :func:`validate_global_plan`; a packed save also checks every rank's table and segments
        (:func:`~.packed_plan.check_packed_plan`)."""
        errors = validate_global_plan(global_plan, metadata)
        if self.packed is not None:
            errors += check_packed_plan(self.packed.layout, global_plan, metadata)
        elif any(PLAN_DIGEST_KEY in (plan.planner_data or {}) for plan in global_plan):
            errors.append(
                "packed layout: some ranks planned a packed save and rank 0 did not; configure every rank alike"
            )
        return errors

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = super()._create_global_plan(all_plans)
        if self.packed is None:
            warn_if_many_chunks(metadata, world_size=len(global_plan))
            return global_plan, metadata
        data = {k: v for k, v in (metadata.planner_data or {}).items() if k != PLAN_DIGEST_KEY}
        data[PACKED_LAYOUT_KEY] = self.packed.layout.to_data()
        return global_plan, dataclasses.replace(metadata, planner_data=data)
