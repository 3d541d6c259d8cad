"""The logical view of a packed checkpoint's metadata: its tensors by name and shape, not its segments.

A packed checkpoint's ``.metadata`` lists flat segments (``_shardline_packed.r<rank>.<dtype>.s<i>``)
where a per-tensor checkpoint lists tensors (``packed_layout.py``). Every shardline reader --
load and its model check, resume, consolidate, HF export, ``load_config``, the launcher's check,
``shardline.checkpoint.Reader`` -- gets its metadata from ``opening.read_checked_metadata``, which
passes it through :func:`logical_metadata`: the segment items are replaced by one
``TensorStorageMetadata`` per table entry (its dtype and global shape), so those readers see the
same keys and shapes as in a per-tensor checkpoint. ``storage_data`` is unchanged: reads still
address the segments (``load_planner.py`` turns a logical tensor into reads of its segments).

Note: why a logical item has one whole-tensor chunk. An item with no chunks would make torch's
resharding planner emit no reads for it: ``dcp.load`` with torch's planner would "load" nothing
and report success. With one chunk covering the tensor, torch's planner emits a read of a
storage index the checkpoint does not have, and :func:`refuse_logical_reads` (run by every
shardline storage reader before it reads) turns that into a clear error naming the way to read
it. Only :class:`~shardline.checkpoint.format.load_planner.ShardlineLoadPlanner` reads packed
tensors.

Note: the table is checked against the stored segments before any reader uses it. Every segment the
table implies must be stored with exactly the size the rule gives and the dtype it names, and
nothing else may be stored under the segment prefix; a table that disagrees (edited, or from
another save) raises :class:`~shardline.errors.IntegrityError` here, while the metadata is read --
before any load has planned a read, let alone written a destination tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardline.checkpoint.format.packed_layout import PackedLayout, is_segment_key, layout_of
from shardline.errors import ConfigurationError, IntegrityError

__all__ = ["logical_metadata", "packed_layout", "refuse_logical_reads"]

_VIEW_KEY = "shardline.packed_view"
"""Key of the view's ``planner_data`` holding the parsed table (marks a Metadata as a view already)."""
_SHOW = 5


def packed_layout(metadata: Metadata | None) -> PackedLayout | None:
    """The layout table of a packed checkpoint (from its view, or parsed from raw metadata), or None."""
    data = metadata.planner_data if metadata is not None else None
    if isinstance(data, Mapping):
        found = data.get(_VIEW_KEY)
        if isinstance(found, PackedLayout):
            return found
    return layout_of(metadata)


def _problems(metadata: Metadata, layout: PackedLayout) -> list[str]:
    expected = layout.expected_segment_sizes()
    problems: list[str] = []
    stored = {k: v for k, v in metadata.state_dict_metadata.items() if is_segment_key(k)}
    for key, numel in sorted(expected.items()):
        md = stored.get(key)
        dtype = key.split(".")[-2]
        if md is None:
            problems.append(f"segment {key} of {numel} elements is not stored")
        elif not isinstance(md, TensorStorageMetadata):
            problems.append(f"segment {key} is stored as bytes, not a tensor")
        elif tuple(md.size) != (numel,):
            problems.append(f"segment {key} is stored with shape {tuple(md.size)}, the table gives ({numel},)")
        elif str(md.properties.dtype).removeprefix("torch.") != dtype:
            problems.append(f"segment {key} is stored as {md.properties.dtype}, the table gives {dtype}")
        elif [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] != [((0,), (numel,))]:
            problems.append(f"segment {key} is stored as {len(md.chunks)} chunk(s), not one whole chunk")
    problems += [
        f"segment {key} is stored but the table implies no such segment"
        for key in sorted(stored)
        if key not in expected
    ]
    clash = [e.key for e in layout.entries if e.key in metadata.state_dict_metadata]
    problems += [f"{key} is stored both packed and as an item of its own" for key in clash]
    return problems


def logical_metadata(metadata: Metadata, *, where: object = "the checkpoint") -> Metadata:
    """``metadata`` with a packed checkpoint's segments replaced by its logical tensors (see the module note).

    A per-tensor checkpoint's metadata, or a view already, is returned as is (the same object).

    Raises:
        IntegrityError: the layout table is malformed, or does not match the stored segments (``where`` names
            the checkpoint; the problems are listed).
    """
    data = metadata.planner_data
    if isinstance(data, Mapping) and isinstance(data.get(_VIEW_KEY), PackedLayout):
        return metadata
    layout = layout_of(metadata, where=where)
    if layout is None:
        return metadata
    problems = _problems(metadata, layout)
    if problems:
        shown = "; ".join(problems[:_SHOW]) + (f"; and {len(problems) - _SHOW} more" if len(problems) > _SHOW else "")
        raise IntegrityError(
            f"{where}: the packed layout table in its metadata does not match the segments it stores -- {shown}; "
            "nothing was read from it. The metadata was altered or belongs to another save: restore the "
            "checkpoint from a copy"
        )
    items: dict[str, Any] = {k: v for k, v in metadata.state_dict_metadata.items() if not is_segment_key(k)}
    for entry in layout.entries:
        dtype = getattr(torch, entry.dtype)
        shape = torch.Size(entry.shape)
        items[entry.key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=shape,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
        )
    mapping = dict(data) if isinstance(data, Mapping) else {}
    # In the flattening's order (the state dict's, as a per-tensor checkpoint lists its items): readers that
    # build state from the metadata (a load's optimizer state) then build it in the same order either way.
    ordered = {k: items.pop(k) for k in mapping if k in items}
    items = ordered | items
    planner_data = {k: v for k, v in mapping.items() if not is_segment_key(str(k))}
    planner_data[_VIEW_KEY] = layout
    return dataclasses.replace(metadata, state_dict_metadata=items, planner_data=planner_data)


def refuse_logical_reads(metadata: Metadata | None, indexes: Iterable[MetadataIndex]) -> None:
    """Raise if any of ``indexes`` (a load plan's storage indexes) addresses a packed tensor itself.

    Raises:
        ConfigurationError: a planner other than shardline's planned a read of a packed tensor as if it were
            stored whole (see the module note); the message names the way to read it.
    """
    layout = packed_layout(metadata)
    if layout is None:
        return
    keys = layout.by_key
    wrong = sorted({index.fqn for index in indexes if index.fqn in keys})
    if wrong:
        listed = ", ".join(wrong[:_SHOW]) + (f" and {len(wrong) - _SHOW} more" if len(wrong) > _SHOW else "")
        raise ConfigurationError(
            f"the checkpoint stores {listed} in the packed layout, which torch's load planner cannot read; load it "
            "with shardline.checkpoint.load, or pass planner=shardline.checkpoint.format.load_planner."
            "ShardlineLoadPlanner() to dcp.load (or consolidate it into safetensors first)"
        )
