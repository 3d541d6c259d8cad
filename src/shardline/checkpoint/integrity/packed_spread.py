"""The segment size of a packed save: small enough that each rank's segments spread over its files.

A per-tensor save spreads a rank's items over ``files_per_rank`` files, each written and hashed
by its own writer thread (:mod:`..coordination.parallelism`). A packed rank has about one segment
per dtype, and DCP never splits an item over two files: cut at the configured size (256 MiB)
alone, its bytes would go to one file, written and hashed on one thread.

Note: why the size is chosen from the table, and why the automatic count counts 8 files. Every
rank builds the same table, and every rank's segments must be the ones the table's rule gives
(the plan check compares them), so the size can only depend on what every rank knows alike: the
table and the configured options. It is ``min(configured, ceil(B / n))``. ``B`` is the largest
share of a rank, from the table in O(tensors): each tensor's bytes at coordinate 0 of its mesh
(``torch.chunk``'s split gives it the most rows; only it writes a replicated tensor), summed --
exactly the largest rank's share when the tensors share a mesh, an upper bound otherwise (a
vectorized pass over every rank would cost each rank 0.18 s per save at 16,384 ranks). ``n`` is
the files each rank writes: ``files_per_rank`` as given or, for the automatic count,
:data:`MAX_FILES_PER_RANK` -- not the cores of this node, which another node may not share --
with at least :data:`PACKED_MIN_FILE_BYTES` per file (64 MiB, where a per-tensor save's automatic count
gives each file 16 MiB: each segment is an item rank 0 plans and records, about 20 us each, and a
16,384-rank job of a 70B model holds 52 MB per rank: cut for 16 MiB files, 56k segments put rank 0's
global plan at 1.2 s and DCP's finish at 0.9 s on the simulator, against 0.51 and 0.22 s for one
segment per rank; a rank's 52 MB is one file's write, where several files gain little). Segments never exceed the size
and hold all of a rank's bytes, so the largest rank has at least ``n`` of them where its pieces
allow it (a piece larger than the size is a segment of its own), and the writer spreads them
over its files by size. The table records the size used, which readers follow.
"""

from __future__ import annotations

import torch

from shardline.checkpoint.coordination.parallelism import AUTO, MAX_FILES_PER_RANK, resolve_files_per_rank
from shardline.checkpoint.format.packed_layout import PackedLayout

__all__ = ["PACKED_MIN_FILE_BYTES", "largest_share", "spread_segment_bytes"]

PACKED_MIN_FILE_BYTES = 64 << 20
"""The automatic count gives each file of a packed rank at least this much (see the module note)."""


def largest_share(layout: PackedLayout) -> int:
    """The bytes a rank stores in segments, at most (all dtypes; see the module note): exact when the tensors
    share a mesh, an upper bound otherwise."""
    total = 0
    for i, spec in enumerate(layout.entries):
        rows = layout.rows_of(i, layout.meshes[spec.mesh].ranks[0])
        if rows is not None:
            total += (rows[1] - rows[0]) * spec.row_numel * getattr(torch, spec.dtype).itemsize
    return total


def spread_segment_bytes(layout: PackedLayout, *, files_per_rank: int) -> int:
    """The segment size a packed save records for ``layout`` (cut at its configured ``segment_bytes``) when each
    rank writes ``files_per_rank`` files (0: automatic); see the module note.

    Raises:
        ConfigurationError: ``files_per_rank`` is not a count.
    """
    files = resolve_files_per_rank(files_per_rank)
    if files_per_rank != AUTO and files <= 1:
        return layout.segment_bytes
    largest = largest_share(layout)
    if files_per_rank == AUTO:
        files = min(MAX_FILES_PER_RANK, largest // PACKED_MIN_FILE_BYTES)
    if files <= 1 or not largest:
        return layout.segment_bytes
    return min(layout.segment_bytes, -(-largest // files))
