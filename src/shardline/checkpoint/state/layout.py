"""How the tensors of a state dict are laid out over the ranks, as the state dict itself shows it.

A checkpoint written by the DCP-native writer (``lifecycle/dcp_writer.py``) comes from a state dict
that shardline did not build (torchtitan's, a Megatron-style trainer's): its engine units are
unknown, so the manifest records what the tensors say instead -- for each DTensor its device
mesh (shape and dimension names) and placements, and ``"plain"`` for a tensor every rank holds
whole (replicated, or saved by one rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["PLAIN", "describe_state_sharding"]

PLAIN = "plain"
"""A tensor that is not a DTensor: each rank holds it whole (replicated, or saved by one rank)."""


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted key, tensor)`` of every tensor in a tree of mappings and lists (DCP's own flattening order)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{i}" if prefix else str(i))


def describe_state_sharding(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The ``sharding`` section of a manifest: every tensor's layout in ``state_dict`` (plain JSON data).

    ``{"source": "state_dict", "meshes": [{"shape", "dim_names"}...], "tensors": {key: {"mesh": i,
    "placements": [...]} or "plain"}}``; ``mesh`` indexes ``meshes`` (one entry per distinct mesh, in order of
    first use), placements are torch's names (``Shard(dim=0)``, ``Replicate()``), dimension names are None
    where the mesh has none.
    """
    meshes: list[dict[str, Any]] = []
    tensors: dict[str, Any] = {}
    for key, tensor in _tensors(state_dict, ""):
        if not isinstance(tensor, DTensor):
            tensors[key] = PLAIN
            continue
        mesh = tensor.device_mesh
        names = mesh.mesh_dim_names
        entry = {"shape": [int(n) for n in mesh.shape], "dim_names": list(names) if names else None}
        if entry not in meshes:
            meshes.append(entry)
        tensors[key] = {"mesh": meshes.index(entry), "placements": [repr(p) for p in tensor.placements]}
    return {"source": "state_dict", "meshes": meshes, "tensors": tensors}
