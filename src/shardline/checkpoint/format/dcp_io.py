"""Reading DCP checkpoints: metadata, key paths, load targets, and a planner that never unpickles code.

Note: top-level keys of the state dict a shardline checkpoint stores (DCP flattens nested
dicts, so on disk they become ``model.<fqn>``, ``optim.state.<fqn>.<name>`` and so on)::

    model              {fqn: tensor or DTensor piece}
    optim              {"state": {fqn: {name: ...}}, "param_groups": [...]}   (torch's layout)
    trainer            bytes: torch.save of the trainer state without "per_rank"
    trainer_per_rank   {"<rank>": bytes}: each rank's "per_rank" entry under its own key
    config             str: the training config as JSON text

Non-tensor items are stored by DCP as ``torch.save`` pickles. DCP's default planner loads them
with ``torch.load(weights_only=False)``, which can run arbitrary code; :class:`SafeLoadPlanner`
loads them with ``weights_only=True`` instead, so a checkpoint can only ever produce data.
``.metadata`` itself is a plain ``pickle``: :func:`unpickle_metadata` reads it with an allowlist
of the classes DCP puts there, and only after its hash was checked (``opening.py``).
"""

from __future__ import annotations

import gc
import io
import os
import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from shardline import _torch_compat
from shardline.checkpoint.format.packed_view import refuse_logical_reads
from shardline.checkpoint.format.safe_state import plainly_safe
from shardline.errors import ConfigurationError, IntegrityError

__all__ = [
    "CONFIG_KEY",
    "MODEL_KEY",
    "OPTIM_KEY",
    "PER_RANK_KEY",
    "TRAINER_KEY",
    "MetadataReader",
    "SafeLoadPlanner",
    "build_tree",
    "decode_state",
    "encode_state",
    "key_paths",
    "set_path",
    "unpickle_metadata",
]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
TRAINER_KEY = "trainer"
PER_RANK_KEY = "trainer_per_rank"
CONFIG_KEY = "config"

StorageMd = TensorStorageMetadata | BytesStorageMetadata


def encode_state(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, checked to load back with ``weights_only=True``.

    Raises:
        ConfigurationError: ``obj`` holds something a safe load cannot restore (an arbitrary
            class, a numpy array...); the message names the type to convert.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if plainly_safe(obj):  # only types the safe load always restores: no need to load it back (safe_state.py)
        return data
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise ConfigurationError(
            f"the {what} cannot be checkpointed safely: it must hold only tensors, numbers, strings, bytes, "
            "booleans, None and dicts/lists/tuples of those (checkpoints are read with "
            f"torch.load(weights_only=True)); "
            f"torch reports: {str(e).splitlines()[0] if str(e) else type(e).__name__}. Convert such values, e.g. numpy "
            "arrays with torch.from_numpy."
        ) from None
    return data


def decode_state(data: bytes) -> Any:
    """Inverse of :func:`encode_state`."""
    return torch.load(io.BytesIO(data), weights_only=True)


def set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """``root[p0][p1]...[pn] = value`` in a tree of dicts and lists built by :func:`build_tree`."""
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (flattening, partial loads allowed) reading non-tensors with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=True, allow_partial_load=True)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle`` limited to the classes a DCP ``.metadata`` file holds (see ``_torch_compat.DCP_METADATA_CLASSES``)."""

    def find_class(self, module: str, name: str) -> Any:
        if not _torch_compat.is_dcp_metadata_global(module, name):
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which DCP metadata never does")


def unpickle_metadata(data: bytes, where: object) -> Metadata:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, refusing any class DCP metadata does not use.

    ``where`` names the file in an error (a path or a location in an object store).

    Raises:
        IntegrityError: the bytes are not DCP metadata (damaged, or naming other classes: never run).
    """
    # Note: the cyclic garbage collector is paused while the objects are built. ``.metadata`` holds one
    # record per saved chunk of every tensor (35M at 16,384 ranks for a 70B model), and each
    # collection the allocations trigger walks every object alive, so a load spent most of its
    # unpickling in the collector (6x the unpickling itself at 1,024 ranks; docs/benchmarks.md).
    # What is built here holds no reference cycles, so pausing leaves no garbage behind; the
    # collector is switched back on only if it was on (another thread may switch it meanwhile:
    # it then runs later, nothing is lost).
    collecting = gc.isenabled()
    gc.disable()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise IntegrityError(
            f"{where} cannot be read as torch.distributed.checkpoint metadata ({type(e).__name__}: {e}); nothing "
            "in it was run"
        ) from None
    finally:
        if collecting:
            gc.enable()
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"{where} holds a {type(metadata).__name__}, not torch.distributed.checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class MetadataReader(FileSystemReader):
    """``FileSystemReader`` that serves metadata already read and checked (it never unpickles ``.metadata``)."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is not None:
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # A packed tensor is read through its segments (ShardlineLoadPlanner); torch's planner would address it
        # whole, at a storage index no file has (packed_view.py).
        refuse_logical_reads(self._metadata, (item.storage_index for item in plan.items))
        return super().prepare_local_plan(plan)


def key_paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """``flat key -> path in the nested state dict`` (a path of one element where DCP recorded no flattening)."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return {key: tuple(mapping.get(key, (key,))) for key in metadata.state_dict_metadata}


def subtree(metadata: Metadata, prefix: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], StorageMd]]:
    """``(path below prefix, storage metadata)`` of every item stored under ``prefix``."""
    out = []
    for key, path in key_paths(metadata).items():
        if path[: len(prefix)] == prefix and len(path) > len(prefix):
            out.append((path[len(prefix) :], metadata.state_dict_metadata[key]))
    return out


def build_tree(entries: Iterable[tuple[tuple[Any, ...], Any]]) -> Any:
    """A tree of dicts (string keys) and lists (integer keys) with each ``value`` at its path."""
    entries = list(entries)
    if not entries:
        return {}
    root: Any = [] if isinstance(entries[0][0][0], int) else {}
    for path, value in entries:
        node = root
        for i, key in enumerate(path):
            last = i == len(path) - 1
            nxt: Any = value if last else ([] if isinstance(path[i + 1], int) else {})
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if last or node[key] is None:
                    node[key] = nxt
                node = node[key]
            else:
                if last or key not in node:
                    node[key] = nxt
                node = node[key]
    return root
