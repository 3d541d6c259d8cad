"""How many chunks a per-tensor save records, and the warning when that many make every save slow.

DCP records one chunk per rank for each tensor a rank holds a piece of: a per-tensor save of T
tensors sharded over W ranks has about W x T chunks, and rank 0 plans, checks and pickles every
one of them into ``.metadata``, which every rank unpickles at load. Rank 0's global plan step
(:class:`~.plan_validation.ShardlineSavePlanner`) has them all in hand, so it counts them there
and, above :data:`MANY_CHUNKS`, tells the user once per process that the packed layout
(``layout="packed"``, ``checkpoint.layout=packed``) records O(W + T) items instead.

Note: where the threshold comes from. docs/benchmarks.md's scale simulation ("Third measurements",
16,384 ranks x 2,169 tensors = 35.5M chunks, rank 0's CPU seconds): DCP's global plan 181.9 s
(:data:`PLAN_SECONDS_PER_CHUNK`, about 5 us per chunk), DCP's finish 215.4 s (6 us), shardline's
plan check 52.5 s (1.5 us), and a 2.9 GB ``.metadata`` (:data:`METADATA_BYTES_PER_CHUNK`, about
82 bytes per chunk). At 1M chunks that is about 5 s of global plan and 13 s of rank-0 CPU per save
in all, plus an 82 MB ``.metadata`` read by every rank: the point where a save's fixed cost stops
being small beside a step's and the packed layout is worth its opt-in; that 70B model's 2,169
tensors (weights and two Adam moments) pass it at about 460 ranks.
"""

from __future__ import annotations

import warnings

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardline.errors import CheckpointWarning

__all__ = [
    "MANY_CHUNKS",
    "METADATA_BYTES_PER_CHUNK",
    "PLAN_SECONDS_PER_CHUNK",
    "chunk_count",
    "many_chunks_message",
    "warn_if_many_chunks",
]

MANY_CHUNKS = 1_000_000
"""Chunks in one per-tensor save above which rank 0 warns (see the module note: ~5 s of global plan)."""
PLAN_SECONDS_PER_CHUNK = 181.9 / 35_536_896
"""DCP's global plan on rank 0 per chunk: 181.9 s for 16,384 x 2,169 chunks (docs/benchmarks.md)."""
METADATA_BYTES_PER_CHUNK = 2.9e9 / 35_536_896
"""``.metadata`` bytes per chunk: 2.9 GB for 16,384 x 2,169 chunks (docs/benchmarks.md)."""

_warned = False
# Note: one warning per process, not per save. A run saves every few hundred steps with the same state, so the
# count does not change between its saves; the message would repeat the same advice each time.


def chunk_count(metadata: Metadata) -> int:
    """The tensor chunks a save's metadata records (one per rank per tensor piece)."""
    return sum(
        len(value.chunks) for value in metadata.state_dict_metadata.values() if isinstance(value, TensorStorageMetadata)
    )


def many_chunks_message(count: int, *, world_size: int) -> str:
    """The warning for a per-tensor save of ``count`` chunks over ``world_size`` ranks."""
    return (
        f"this per-tensor checkpoint records {count:,} tensor chunks ({world_size:,} ranks x their tensors): rank 0 "
        f"spends about {count * PLAN_SECONDS_PER_CHUNK:.0f} s of CPU in DCP's global plan alone on every save "
        f"(~{PLAN_SECONDS_PER_CHUNK * 1e6:.0f} us per chunk, docs/benchmarks.md), about as long again in DCP's "
        f"finish, and .metadata grows to about {count * METADATA_BYTES_PER_CHUNK / 1e6:,.0f} MB that every rank "
        "reads at load. Save with layout='packed' (checkpoint.layout=packed, CheckpointManager(layout='packed')) to "
        "record a few segments per rank instead (docs/checkpoint-protocol.md, Packed layout)"
    )


def warn_if_many_chunks(metadata: Metadata, *, world_size: int) -> int:
    """Count ``metadata``'s chunks; above :data:`MANY_CHUNKS`, warn (the first time in this process). Returns the
    count."""
    global _warned
    count = chunk_count(metadata)
    if count > MANY_CHUNKS and not _warned:
        _warned = True
        warnings.warn(many_chunks_message(count, world_size=world_size), CheckpointWarning, stacklevel=2)
    return count
