"""Where every element of a unit's parameters lives: pure arithmetic, no tensors.

Each parameter is split on dim 0 exactly like ``torch.chunk(param, n, dim=0)``: ``c =
ceil(rows / n)`` rows per rank, the last non-empty rank gets the remainder, ranks past the end
get nothing. That is also how a DTensor ``Shard(0)`` placement splits, so a local shard is a
DTensor piece as is.

Note: the flat buffer. For communication a unit packs its parameters into one flat buffer
per rank: parameter ``i`` occupies ``c_i * row_numel_i`` elements (its chunk, zero-padded to
``c_i`` rows) at a fixed offset, identical on every rank. An all-gather of these equal-sized
per-rank buffers yields ``[rank0: p0 p1 ..., rank1: p0 p1 ..., ...]``; viewed as ``(n, S)``,
column block ``i`` holds parameter ``i``'s padded rows in order, so copy-out is one strided
copy per parameter. Gradients use the same packing (over trainable parameters only) for the
reduce-scatter, whose output on each rank is exactly its own packed shard.

Communication volume per unit is therefore ``n * S`` elements with ``S = sum_i c_i *
row_numel_i``; padding costs at most ``n - 1`` rows per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FlatLayout", "ParamLayout", "chunk_rows", "contiguous_stride", "shard_row_range"]

# Element alignment of each parameter inside gathered (unsharded) buffers, so that gathered
# parameters start on 64-byte boundaries for fp32 (32 bytes for bf16).
UNSHARDED_ALIGN = 16


def chunk_rows(rows: int, world: int) -> int:
    """Rows per rank when ``rows`` are split ``torch.chunk``-style across ``world`` ranks."""
    return math.ceil(rows / world) if rows > 0 else 0


def shard_row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, count)`` of the rows rank ``rank`` owns; ``count`` may be 0."""
    c = chunk_rows(rows, world)
    start = min(rank * c, rows)
    return start, max(0, min(c, rows - start))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (empty dimensions count as 1)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's shape and this rank's piece of it.

    A 0-d parameter is handled as shape ``(1,)`` (``rows == 1``); ``shape`` keeps ``()``.
    """

    shape: tuple[int, ...]
    rows: int
    row_numel: int
    chunk: int
    row_start: int
    local_rows: int

    @classmethod
    def build(cls, shape: Sequence[int], world: int, rank: int) -> ParamLayout:
        shape = tuple(int(s) for s in shape)
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:]) if shape else 1
        start, count = shard_row_range(rows, world, rank)
        return cls(shape, rows, row_numel, chunk_rows(rows, world), start, count)

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements one rank contributes to the flat buffer (its chunk padded to ``chunk`` rows)."""
        return self.chunk * self.row_numel

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's shard (always at least 1-D)."""
        return (self.local_rows, *self.shape[1:])

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of a sequence of parameters in the per-rank flat buffer and in the gathered buffer.

    Attributes:
        params: The parameters, in buffer order.
        world: Number of ranks the buffer is sharded over.
        offsets: Start of each parameter's padded chunk inside one rank's flat buffer.
        shard_numel: Elements in one rank's flat buffer (``S``).
        unsharded_offsets: Start of each parameter inside the gathered, parameter-major buffer,
            where parameter ``i`` takes ``world * chunk_i`` rows.
        unsharded_numel: Elements of the gathered, parameter-major buffer.
    """

    params: tuple[ParamLayout, ...]
    world: int
    offsets: tuple[int, ...]
    shard_numel: int
    unsharded_offsets: tuple[int, ...]
    unsharded_numel: int

    @classmethod
    def build(cls, params: Sequence[ParamLayout], world: int) -> FlatLayout:
        offsets, unsharded_offsets = [], []
        shard = unsharded = 0
        for p in params:
            offsets.append(shard)
            shard += p.padded_numel
            unsharded = _align(unsharded, UNSHARDED_ALIGN) if world > 1 else unsharded
            unsharded_offsets.append(unsharded)
            unsharded += world * p.padded_numel if world > 1 else p.numel
        return cls(tuple(params), world, tuple(offsets), shard, tuple(unsharded_offsets), unsharded)

    @property
    def padded_sizes(self) -> list[int]:
        """Per-parameter padded chunk sizes (the column blocks of the ``(world, S)`` view)."""
        return [p.padded_numel for p in self.params]
