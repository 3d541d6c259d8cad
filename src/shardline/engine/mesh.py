"""Which process groups a unit talks over, resolved from what the user passed as ``mesh``.

A unit sees data-parallel ranks as ``shard`` x ``replicate``: parameters are partitioned
across the shard group and gradients are additionally averaged across the replicate group.

=========================  ==============  ==================  =========================
strategy                   shard group     replicate group     ``mesh`` argument
=========================  ==============  ==================  =========================
FULL_SHARD, SHARD_GRAD_OP  all ranks       --                  None, a group, a 1-D mesh
SHARD_OPT                  all ranks (*)   --                  None, a group, a 1-D mesh
NO_SHARD                   --              all ranks           None, a group, a 1-D mesh
HYBRID_SHARD(_ZERO2)       mesh["shard"]   mesh["replicate"]   a 2-D DeviceMesh
=========================  ==============  ==================  =========================

(*) SHARD_OPT keeps full parameters on every rank; the shard group is what its optimizer
state is split across and what its gradients are all-reduced over.

Note: the 2-D mesh. ``hybrid_mesh(replicate_size=R, shard_size=S)`` builds the mesh
``init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))``: rank ``r`` is in
shard group ``r // S`` (consecutive ranks, so on a machine with ``S`` devices per node the
all-gathers and reduce-scatters stay inside a node) and replica group ``r % S``. A 2-D mesh
built elsewhere works too: its dimensions are found by name (``replicate``/``shard``, or any
names containing them such as ``dp_replicate``/``dp_shard``), else by position (replicate
first, the order torch's FSDP2 and Lightning's ``ModelParallelStrategy`` use).

Note: partial resharding. ``reshard_after_forward=N`` keeps, after forward, each rank's piece
of the parameters split over its *post-forward group*: ``N`` consecutive ranks of the shard
group. Backward then all-gathers over those ``N`` ranks only (``post_forward_group``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardline import _torch_compat
from shardline.engine.device import check_communicable, default_device_type, group_device_map
from shardline.engine.strategy import StrategyPolicy
from shardline.errors import ConfigurationError, DistributedNotInitializedError

__all__ = [
    "MeshLike",
    "ShardMesh",
    "hybrid_degrees",
    "hybrid_mesh",
    "post_forward_group",
    "require_process_group",
    "resolve_mesh",
]

MeshLike = DeviceMesh | dist.ProcessGroup | None


def require_process_group(what: str) -> None:
    """Raise a helpful error if ``torch.distributed`` is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedNotInitializedError(
            f"{what} needs an initialized torch.distributed process group, and none exists. "
            "Launch with torchrun and call torch.distributed.init_process_group() (or "
            "shardline.init_distributed()) before sharding; for a single process, "
            "shardline.init_distributed() creates a one-rank group."
        )


def _world_group() -> dist.ProcessGroup:
    """The default (world) process group, once ``torch.distributed`` is initialized."""
    group = dist.group.WORLD
    if group is None:
        require_process_group("shardline")
    assert group is not None  # require_process_group raised otherwise
    return group


@dataclass(frozen=True, eq=False)
class ShardMesh:
    """The communication groups of one unit.

    Attributes:
        dp_group: All data-parallel ranks of the unit. The global gradient norm is reduced over it.
        shard_group: Parameters (SHARD_OPT: optimizer state) are split across these ranks
            (``None``: not split).
        replicate_group: Gradients are also all-reduced across these ranks (``None``: no replicas).
        device_map: ``{device type: backend}`` the group communicates (from
            ``dist.get_backend_config``: ``{"cpu": "gloo", "cuda": "nccl"}``); empty when unknown
            (then any device is accepted). See :mod:`shardline.engine.device`.
        device_mesh: The DeviceMesh the user passed (1-D, or 2-D for hybrid sharding). Its own
            device type does not decide the unit's device: DTensor views use a mesh over the same
            groups for the parameters' device (:meth:`dtensor_placement`).
        replicate_dim: For a 2-D mesh, which of its dimensions is the replica dimension.
    """

    dp_group: dist.ProcessGroup
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    device_map: Mapping[str, str]
    device_mesh: DeviceMesh | None = None
    replicate_dim: int = 0

    @property
    def device_types(self) -> frozenset[str]:
        """Device types the group communicates; empty when unknown."""
        return frozenset(self.device_map)

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

    @property
    def is_hybrid(self) -> bool:
        """Sharded inside groups of a 2-D mesh and replicated across them."""
        return self.device_mesh is not None and self.device_mesh.ndim == 2

    def same_dp_group(self, other: ShardMesh) -> bool:
        """Whether both meshes average over the same ranks."""
        return self.dp_group is other.dp_group or (
            dist.get_process_group_ranks(self.dp_group) == dist.get_process_group_ranks(other.dp_group)
        )

    def check_device(self, device: torch.device, where: str) -> None:
        """Raise if the group cannot communicate tensors on ``device`` (the message names both)."""
        check_communicable(device, self.device_map, str(dist.get_backend(self.dp_group)), where=where)

    def dtensor_placement(self, device_type: str) -> tuple[DeviceMesh, list[Placement]]:
        """The mesh and placements that show a local shard as a DTensor piece.

        ``Shard(0)`` over the shard group; ``[Replicate(), Shard(0)]`` over a hybrid 2-D mesh
        (in the mesh's dimension order); ``Replicate()`` when nothing is split (NO_SHARD).
        """
        if self.is_hybrid:
            assert self.device_mesh is not None
            placements: list[Placement] = [Shard(0), Shard(0)]
            placements[self.replicate_dim] = Replicate()
            return _mesh_for_device(self.device_mesh, device_type), placements
        if self.device_mesh is not None:
            return _mesh_for_device(self.device_mesh, device_type), [Shard(0) if self.shard_size > 1 else Replicate()]
        group = self.shard_group if self.shard_group is not None else self.dp_group
        return _device_mesh_from_group(group, device_type), [Shard(0) if self.shard_size > 1 else Replicate()]

    @staticmethod
    def group_rank_of(group: dist.ProcessGroup, global_rank: int) -> int:
        """``global_rank``'s rank within ``group`` (0 when it is not a member)."""
        ranks = dist.get_process_group_ranks(group)
        return ranks.index(global_rank) if global_rank in ranks else 0

    def replica_source(self) -> int:
        """The rank, within this rank's replica group, that belongs to the shard group holding global rank 0."""
        assert self.replicate_group is not None
        source: set[int] = set()
        if self.is_hybrid:
            assert self.device_mesh is not None
            grid = self.device_mesh.mesh
            replica = int((grid == 0).nonzero()[0][self.replicate_dim])
            source = set(grid.select(self.replicate_dim, replica).flatten().tolist())
        for index, rank in enumerate(dist.get_process_group_ranks(self.replicate_group)):
            if rank in source:
                return index
        return 0

    def places_like(self, mesh: DeviceMesh, placements: tuple[Placement, ...], device_type: str) -> bool:
        """Whether a DTensor on ``mesh`` with ``placements`` is split exactly like this mesh's pieces."""
        own_mesh, own = self.dtensor_placement(device_type)
        return tuple(own) == tuple(placements) and mesh.mesh.tolist() == own_mesh.mesh.tolist()


@functools.cache
def _device_mesh_from_group(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)


@functools.cache
def _mesh_for_device(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """``mesh``, or a mesh over the same process groups for ``device_type`` (a CPU mesh, CUDA parameters)."""
    if mesh.device_type == device_type:
        return mesh
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return DeviceMesh.from_group(
        groups if mesh.ndim > 1 else groups[0], device_type, mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names
    )


# ---------------------------------------------------------------------- hybrid (2-D) meshes
def hybrid_degrees(*, world_size: int, replicate_size: int = -1, shard_size: int = -1) -> tuple[int, int]:
    """``(replicate_size, shard_size)`` whose product is ``world_size``; ``-1`` means infer that one.

    Raises:
        ConfigurationError: A size is neither -1 nor positive, both are -1, one does not divide
            the world size, or the two do not multiply to it. The message names both.
    """
    for name, value in (("replicate_size", replicate_size), ("shard_size", shard_size)):
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ConfigurationError(f"{name} must be a positive integer or -1 (infer it), got {value!r}")
    if replicate_size == -1 and shard_size == -1:
        raise ConfigurationError(
            f"hybrid sharding needs replicate_size or shard_size (the other may be -1 to infer it); got both -1 "
            f"for {world_size} ranks. E.g. shard_size=<devices per node> and replicate_size=-1."
        )
    r, s = replicate_size, shard_size
    if r == -1 and world_size % s == 0:
        r = world_size // s
    elif s == -1 and world_size % r == 0:
        s = world_size // r
    if r < 1 or s < 1 or r * s != world_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigurationError(
            f"replicate_size={replicate_size} x shard_size={shard_size} does not match the world size "
            f"{world_size}: the two degrees must multiply to the number of ranks (-1 infers one of them). "
            f"Pick them among the divisors of {world_size}: {divisors}."
        )
    return r, s


def hybrid_mesh(*, replicate_size: int = -1, shard_size: int = -1, device_type: str | None = None) -> DeviceMesh:
    """A 2-D ``DeviceMesh`` (replicate, shard) over all ranks, for ``strategy="hybrid_shard"``.

    ``-1`` infers one degree from the world size (see :func:`hybrid_degrees`). Ranks
    ``k*S .. k*S+S-1`` form shard group ``k``. A collective: every rank must call it.

    >>> mesh = shardline.hybrid_mesh(shard_size=8)           # 8 devices per node
    >>> shardline.wrap(model, policy, strategy="hybrid_shard", mesh=mesh)
    """
    require_process_group("shardline.hybrid_mesh")
    r, s = hybrid_degrees(world_size=dist.get_world_size(), replicate_size=replicate_size, shard_size=shard_size)
    if device_type is None:  # the model's device decides in the end: see ShardMesh.dtensor_placement
        device_type = default_device_type(group_device_map(_world_group()), cuda_available=torch.cuda.is_available())
    return init_device_mesh(device_type, (r, s), mesh_dim_names=("replicate", "shard"))


def _hybrid_dims(mesh: DeviceMesh) -> tuple[int, int]:
    """``(replicate_dim, shard_dim)`` of a 2-D mesh: by name when its names say so, else (0, 1)."""
    names = [n.lower() for n in (mesh.mesh_dim_names or ())]
    if len(names) == 2:
        rep = [i for i, n in enumerate(names) if "replicate" in n]
        shard = [i for i, n in enumerate(names) if "shard" in n]
        if len(rep) == 1 and len(shard) == 1 and rep != shard:
            return rep[0], shard[0]
    return 0, 1


@functools.cache
def _group_of_ranks(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group of exactly ``ranks`` (created once; only its members need to call this)."""
    if list(ranks) == list(range(dist.get_world_size())):
        return _world_group()
    timeout = _torch_compat.group_timeout(None)
    group: dist.ProcessGroup = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)
    return group


def post_forward_group(mesh: ShardMesh, size: int) -> dist.ProcessGroup:
    """This rank's post-forward group: ``size`` consecutive ranks of its shard group (see the note at the top)."""
    assert mesh.shard_group is not None
    assert mesh.shard_size % size == 0
    ranks = dist.get_process_group_ranks(mesh.shard_group)
    start = mesh.shard_rank // size * size
    return _group_of_ranks(tuple(sorted(ranks[start : start + size])))


# ---------------------------------------------------------------------- resolution
def resolve_mesh(mesh: MeshLike, policy: StrategyPolicy, strategy_name: str = "") -> ShardMesh:
    """Turn ``fully_shard``'s ``mesh`` argument into the unit's groups for ``policy``."""
    require_process_group("shardline.fully_shard")
    name = strategy_name or "this strategy"
    non_member: object = dist.GroupMember.NON_GROUP_MEMBER  # what new_group returns off its ranks (an int)
    if mesh is non_member:
        raise ConfigurationError(
            f"this process (global rank {dist.get_rank()}) is not a member of the process group passed as mesh: "
            "torch.distributed.new_group() returned GroupMember.NON_GROUP_MEMBER here. Every rank that runs "
            "the model must be in the group it is sharded over; build and shard the model on member ranks only."
        )
    if policy.hybrid:
        return _resolve_hybrid(mesh, name)
    device_mesh: DeviceMesh | None = None
    if mesh is None:
        group = _world_group()
    elif isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ConfigurationError(
                f"strategy {name} shards over one mesh dimension, but got a {mesh.ndim}-D mesh of shape "
                f"{tuple(mesh.shape)} (dims {mesh.mesh_dim_names}). For a (replicate, shard) mesh use "
                "strategy='hybrid_shard' or 'hybrid_shard_zero2'; otherwise pass one dimension, e.g. mesh['dp']."
            )
        group = mesh.get_group()
        device_mesh = mesh
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise ConfigurationError(
            f"mesh must be a torch.distributed ProcessGroup, a DeviceMesh or None (the world), "
            f"got {type(mesh).__name__}: {mesh!r}"
        )
    _check_member(group)
    devices = group_device_map(group)
    if policy.shard_optimizer:  # ZeRO-1/2/3: split across the group
        return ShardMesh(group, group, None, devices, device_mesh)
    return ShardMesh(group, None, group, devices, device_mesh)


def _check_member(group: dist.ProcessGroup) -> None:
    if dist.get_rank(group) < 0:
        raise ConfigurationError(
            f"this process (global rank {dist.get_rank()}) is not a member of the mesh's process group "
            f"(ranks {dist.get_process_group_ranks(group)}). Every rank that runs the model must be in "
            "the group it is sharded over; build the model on member ranks only."
        )


def _resolve_hybrid(mesh: MeshLike, name: str) -> ShardMesh:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        got = (
            f"a {mesh.ndim}-D DeviceMesh of shape {tuple(mesh.shape)}"
            if isinstance(mesh, DeviceMesh)
            else ("no mesh" if mesh is None else f"a {type(mesh).__name__}")
        )
        raise ConfigurationError(
            f"strategy {name} shards inside groups and replicates across them, so it needs a 2-D DeviceMesh "
            f"(replicate, shard); got {got}. Build one with shardline.hybrid_mesh(replicate_size=R, "
            "shard_size=S) (or torch's init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard'))) "
            "and pass it as mesh=."
        )
    if mesh.get_coordinate() is None:
        raise ConfigurationError(
            f"this process (global rank {dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}; every rank "
            "that runs the model must be in the mesh it is sharded over."
        )
    rep_dim, shard_dim = _hybrid_dims(mesh)
    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    dp_group = _group_of_ranks(ranks)
    return ShardMesh(
        dp_group,
        mesh.get_group(shard_dim),
        mesh.get_group(rep_dim),
        group_device_map(dp_group),
        mesh,
        replicate_dim=rep_dim,
    )
