"""Which process groups a unit talks over, resolved from what the user passed as ``mesh``.

A unit sees data-parallel ranks as ``shard`` x ``replicate``: parameters are partitioned
across the shard group and gradients are additionally averaged across the replicate group.
FULL_SHARD / SHARD_GRAD_OP use (world, 1), NO_SHARD uses (1, world); hybrid sharding will be a
2-D mesh with both sizes above one, with no change to the unit code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardline.engine.strategy import StrategyPolicy
from shardline.errors import ConfigurationError, DistributedNotInitializedError

__all__ = ["MeshLike", "ShardMesh", "require_process_group", "resolve_mesh"]

MeshLike = DeviceMesh | dist.ProcessGroup | None

_BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}


def require_process_group(what: str) -> None:
    """Raise a helpful error if ``torch.distributed`` is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedNotInitializedError(
            f"{what} needs an initialized torch.distributed process group, and none exists. "
            "Launch with torchrun and call torch.distributed.init_process_group() (or "
            "shardline.init_distributed()) before sharding; for a single process, "
            "shardline.init_distributed() creates a one-rank group."
        )


@dataclass(frozen=True, eq=False)
class ShardMesh:
    """The communication groups of one unit.

    Attributes:
        dp_group: All data-parallel ranks of the unit. Gradients are averaged over it and the
            global gradient norm is reduced over it.
        shard_group: Parameters are split across these ranks (``None``: not split).
        replicate_group: Gradients are also all-reduced across these ranks (``None``: no replicas).
        device_types: Device types the backend can communicate (``cpu`` for gloo, ``cuda`` for
            NCCL); empty when unknown (then any device is accepted).
    """

    dp_group: dist.ProcessGroup
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    device_types: frozenset[str]
    device_mesh: DeviceMesh | None = None

    @functools.cached_property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    @functools.cached_property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @functools.cached_property
    def shard_size(self) -> int:
        return 1 if self.shard_group is None else dist.get_world_size(self.shard_group)

    @functools.cached_property
    def shard_rank(self) -> int:
        return 0 if self.shard_group is None else dist.get_rank(self.shard_group)

    @functools.cached_property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @functools.cached_property
    def replicate_rank(self) -> int:
        return 0 if self.replicate_group is None else dist.get_rank(self.replicate_group)

    def same_dp_group(self, other: ShardMesh) -> bool:
        """Whether both meshes average over the same ranks."""
        return self.dp_group is other.dp_group or (
            dist.get_process_group_ranks(self.dp_group) == dist.get_process_group_ranks(other.dp_group)
        )

    def check_device(self, device: torch.device, where: str) -> None:
        """Raise if the backend cannot communicate tensors on ``device``."""
        if device.type == "meta" or not self.device_types or device.type in self.device_types:
            return
        backend = dist.get_backend(self.dp_group)
        want = " or ".join(sorted(self.device_types))
        raise ConfigurationError(
            f"{where} is on {device}, but the mesh's backend {backend!r} communicates {want} tensors. "
            f"Move the module to {want} before sharding (module.to(...)), or create the process group "
            f"with a backend for {device.type} (gloo for cpu, nccl for cuda)."
        )

    def device_mesh_for(self, device_type: str) -> DeviceMesh:
        """A 1-D DeviceMesh over the shard group, for exposing shards as DTensors."""
        if self.device_mesh is not None:
            return self.device_mesh
        group = self.shard_group if self.shard_group is not None else self.dp_group
        return _device_mesh_from_group(group, device_type)


@functools.cache
def _device_mesh_from_group(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)


def _backend_devices(group: dist.ProcessGroup) -> frozenset[str]:
    backend = str(dist.get_backend(group))
    devices: set[str] = set()
    for part in backend.split(","):
        if ":" in part:  # "cpu:gloo,cuda:nccl"
            device, _, _name = part.partition(":")
            devices.add(device)
        elif part in _BACKEND_DEVICES:
            devices.add(_BACKEND_DEVICES[part])
        else:  # a backend we do not know: do not guess
            return frozenset()
    return frozenset(devices)


def resolve_mesh(mesh: MeshLike, policy: StrategyPolicy) -> ShardMesh:
    """Turn ``fully_shard``'s ``mesh`` argument into the unit's groups for ``policy``."""
    require_process_group("shardline.fully_shard")
    device_mesh: DeviceMesh | None = None
    if mesh is dist.GroupMember.NON_GROUP_MEMBER:
        raise ConfigurationError(
            f"this process (global rank {dist.get_rank()}) is not a member of the process group passed as mesh: "
            "torch.distributed.new_group() returned GroupMember.NON_GROUP_MEMBER here. Every rank that runs "
            "the model must be in the group it is sharded over; build and shard the model on member ranks only."
        )
    if mesh is None:
        group = dist.group.WORLD
        devices = _backend_devices(group)
    elif isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ConfigurationError(
                f"fully_shard takes a 1-D DeviceMesh, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} "
                f"(dims {mesh.mesh_dim_names}). Pass the data-parallel dimension, e.g. mesh['dp'], or a "
                "ProcessGroup; hybrid sharding over 2-D meshes is planned but not available yet."
            )
        group = mesh.get_group()
        devices = frozenset({mesh.device_type})
        device_mesh = mesh
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
        devices = _backend_devices(group)
    else:
        raise ConfigurationError(
            f"mesh must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None (the world), "
            f"got {type(mesh).__name__}: {mesh!r}"
        )
    if dist.get_rank(group) < 0:
        raise ConfigurationError(
            f"this process (global rank {dist.get_rank()}) is not a member of the mesh's process group "
            f"(ranks {dist.get_process_group_ranks(group)}). Every rank that runs the model must be in "
            "the group it is sharded over; build the model on member ranks only."
        )
    if policy.shard_params:
        return ShardMesh(group, group, None, devices, device_mesh)
    return ShardMesh(group, None, group, devices, device_mesh)
