"""Reading packed tensors: each rank's pieces of the logical tensors as one read per stored segment.

A packed checkpoint stores each writer's rows of every tensor in a few flat segments
(``packed_layout.py``). To load a piece -- a range of whole rows of a tensor, as a row-sharded
DTensor or a whole tensor holds it -- the layout's rule names the writers of those rows
(``PackedLayout.sources``) and where each writer put them (``PackedLayout.locate``).
:class:`PackedReads` collects, over every piece this rank loads, the elements it needs from
each segment, and plans **one** ``ReadItem`` per segment covering their span; the planner hands
the reader a staging buffer for it and copies its rows into every piece it serves on commit.

Note: why one item per segment, not per (piece, segment). DCP's ``FileSystemReader`` deserializes
the whole stored item for each ``ReadItem`` (``torch.load`` in ``read_data``), and so does the
object-store reader (``FsspecReader`` is the same code); a rank loading a thousand tensors out of
one segment with an item per tensor would read that segment a thousand times. With one item per
segment a same-layout load reads each of its own segments once, and a resharded load reads only
the segments that overlap its pieces, each once (only the span it needs is kept: the staging
buffer is the span, not the segment). shardline's verifying reader decodes a stored item once
per distinct item anyway, so it gains nothing and loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from shardline import _torch_compat
from shardline.checkpoint.format.packed_layout import PackedLayout
from shardline.errors import CheckpointMismatchError, IntegrityError

__all__ = ["PackedReads"]


@dataclass
class _Span:
    """What this rank reads from one segment: elements ``[start, stop)`` and the copies they feed."""

    dtype: torch.dtype
    start: int
    stop: int
    copies: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (segment offset, numel, target)


def _describe(value: object) -> str:
    if isinstance(value, DTensor):
        return f"a DTensor placed {tuple(value.placements)} on a mesh of shape {tuple(value.device_mesh.shape)}"
    return type(value).__name__


class PackedReads:
    """The reads of packed tensors one rank plans (see the module note); one per load plan."""

    def __init__(self, layout: PackedLayout) -> None:
        self.layout = layout
        self._spans: dict[str, _Span] = {}

    def add(self, fqn: str, value: object) -> None:
        """Plan this rank's pieces of packed tensor ``fqn`` (``value``: the DTensor or plain tensor to load into).

        Raises:
            CheckpointMismatchError: a piece that is not a range of whole rows (dimension 0, every other
                dimension whole), or a target with several local pieces.
        """
        entry_index = self.layout.by_key[fqn]
        entry = self.layout.entries[entry_index]
        try:
            chunks = _torch_compat.local_chunks(value)
        except ValueError:
            chunks = []
        local = value.to_local() if isinstance(value, DTensor) else value
        if isinstance(local, torch.Tensor):
            local = local.detach()
        shape = tuple(entry.shape)
        whole_rows = (
            len(chunks) == 1
            and isinstance(local, torch.Tensor)
            and tuple(chunks[0].sizes[1:]) == shape[1:]
            and all(o == 0 for o in chunks[0].offsets[1:])
            and tuple(local.shape) == tuple(chunks[0].sizes)
        )
        if not whole_rows:
            held = (
                f"{len(chunks)} pieces"
                if len(chunks) != 1
                else f"offsets {tuple(chunks[0].offsets)}, sizes {tuple(chunks[0].sizes)}"
            )
            raise CheckpointMismatchError(
                f"{fqn} is stored in the packed layout (global shape {shape}) and this rank's target is "
                f"{_describe(value)} holding {held}: a packed checkpoint loads into tensors sharded by rows "
                "(Shard(0) on one mesh dimension, Replicate on the others) or whole tensors. Load it with such a "
                "layout, or consolidate it into safetensors first (shardline consolidate)"
            )
        assert isinstance(local, torch.Tensor)
        first = int(chunks[0].offsets[0])
        rows = int(chunks[0].sizes[0])
        if not rows or not entry.row_numel:
            return  # nothing stored, nothing to read
        dtype = getattr(torch, entry.dtype)
        row_numel = entry.row_numel
        for writer, lo, hi in self.layout.sources(entry_index, first, first + rows):
            segment, piece = self.layout.locate(entry_index, writer)
            offset = piece.offset + (lo - piece.start) * row_numel
            numel = (hi - lo) * row_numel
            span = self._spans.get(segment.key)
            if span is None:
                span = self._spans[segment.key] = _Span(dtype, offset, offset + numel)
            span.start, span.stop = min(span.start, offset), max(span.stop, offset + numel)
            span.copies.append((offset, numel, local.narrow(0, lo - first, hi - lo)))

    def read_items(self) -> list[ReadItem]:
        """One ``ReadItem`` per segment this rank reads, covering the elements it needs from it."""
        items = []
        for key, span in sorted(self._spans.items()):
            if span.stop <= span.start:
                continue
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(key, (span.start,)),
                    dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex(key, (0,), 0),
                    storage_offsets=torch.Size([span.start]),
                    lengths=torch.Size([span.stop - span.start]),
                )
            )
        return items

    @property
    def elements_planned(self) -> dict[str, int]:
        """Elements read per segment key (each read's span)."""
        return {key: span.stop - span.start for key, span in self._spans.items() if span.stop > span.start}

    def owns(self, item: ReadItem) -> bool:
        """Whether ``item`` is one of this object's segment reads."""
        return item.dest_index.fqn in self._spans

    def staging(self, item: ReadItem) -> torch.Tensor:
        """A buffer for ``item``'s span of its segment (the reader copies the stored elements into it)."""
        span = self._spans[item.dest_index.fqn]
        return torch.empty(span.stop - span.start, dtype=span.dtype)

    def commit(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Copy the rows ``tensor`` (the filled staging buffer) holds into every piece they serve."""
        span = self._spans[item.dest_index.fqn]
        if tensor.numel() != span.stop - span.start:
            raise IntegrityError(
                f"segment {item.dest_index.fqn}: read {tensor.numel()} elements where the packed layout needs "
                f"{span.stop - span.start}"
            )
        for offset, numel, target in span.copies:
            source = tensor.narrow(0, offset - span.start, numel)
            target.copy_(source.view(target.shape))
