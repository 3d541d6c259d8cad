"""The one place where shardline touches torch internals or version-dependent APIs.

A torch upgrade that moves any of these should only require edits in this file. When this
module is first imported (by ``import shardline``) it checks the installed torch once: its
version against :data:`SUPPORTED_TORCH` and every private API used here that ``import torch``
has loaded (:func:`_check_installed`), raising one error that names each one missing, the
installed version and the supported range. The few that live in modules torch loads on demand
(dynamo, most of DCP) are not imported for the check (DCP's planners are: shardline's save
planner subclasses torch's here, and its load planner uses torch's planning helpers); ``nox -s
compat`` runs them on the releases listed in docs/testing.md.

Note: why torch 2.11 is the floor. torch 2.6, the floor declared before, fails on its first
gradient reduction on CPU (gloo has no ``ReduceOp.AVG`` there), and its DCP lacks what the
checkpoint writer uses (``dcp.save(no_dist=)``, the writer's ``rank``); supporting it would mean
emulating collectives and DCP internals in the engine and the checkpoint writer. 2.11 is the
oldest release run since (docs/testing.md).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _version, default_planner, planner_helpers
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)

from shardline.errors import ConfigurationError

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import ReadItem, SavePlan
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.tensor import DTensor

__all__ = [
    "DCP_METADATA_CLASSES",
    "SAVE_CRC32_PER_CONTEXT",
    "SUPPORTED_TORCH",
    "TORCH_PLAN_CHECK_FAILED",
    "ValidatingSavePlanner",
    "all_gather_into",
    "compiled_autograd_active",
    "dtensor_with_local",
    "eager_only",
    "elastic_launch_config",
    "fake_tensor_mode",
    "fsdp2_settings",
    "group_timeout",
    "in_backward",
    "is_dcp_metadata_global",
    "is_sharded_tensor",
    "local_chunks",
    "parameter_fqns",
    "profiling_enabled",
    "queue_backward_callback",
    "read_items_by_torch",
    "reduce_scatter_into",
    "set_writer_filesystem",
    "sharded_tensor_local_bytes",
    "skip_save_crc32_here",
    "storage_key",
    "take_pre_2_4_keys",
    "tensor_pickle_global",
    "torch_validate_global_plan",
    "typed_storage_dtype",
    "version_of",
]

SUPPORTED_TORCH = ">=2.11"
"""The torch releases shardline supports (pyproject.toml declares the same; those run are in docs/testing.md)."""
_TORCH_FLOOR = "2.11"

# torch 2.13 renamed the single-tensor collectives (``*_into_tensor`` -> ``*_single``) and
# deprecated the old names; torch 2.6 only has the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """All-gather ``input`` from every rank of ``group`` into ``output`` (rank-major)."""
    work: dist.Work | None = _all_gather(output, input, group=group, async_op=async_op)
    return work


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` (rank-major) over ``group`` and keep this rank's slice in ``output``."""
    work: dist.Work | None = _reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    return work


def eager_only(fn: Callable[..., Any], *, reason: str) -> Callable[..., Any]:
    """``fn`` as a callable that ``torch.compile`` never traces: it runs eagerly, between compiled graphs.

    Dynamo compiles the frames a compiled module's ``__call__`` runs, forward hooks included,
    unless the hook is marked as skipped (``torch._dynamo.disable``): the hook then runs in
    eager mode, and a compiled ``forward`` is its own graph. torch's FSDP2 marks its hooks the
    same way. Inside a graph that inlines a call to such a module (``torch.compile`` of a model
    that contains it), the call is a graph break.
    """
    eager: Callable[..., Any] = torch._dynamo.disable(fn, recursive=True, reason=reason)
    return eager


def compiled_autograd_active() -> bool:
    """Whether compiled autograd (``torch._dynamo.compiled_autograd``) is capturing this backward pass."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region)


def in_backward() -> bool:
    """True while the autograd engine is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished all its nodes.

    Must be called from inside a backward pass (a hook). There is no public API for this;
    torch's own FSDP uses the same engine entry point.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def set_writer_filesystem(writer: FileSystemWriter, filesystem: FileSystem) -> None:
    """Make a ``torch.distributed.checkpoint.FileSystemWriter`` open its files through ``filesystem``.

    ``FileSystemWriter`` keeps the ``FileSystem`` it writes through in the attribute ``fs``
    (set in its constructor, used by ``write_data`` and ``finish``); there is no constructor
    argument for it. Replacing it is how shardline hashes every file in the pass that writes it.
    """
    if not hasattr(writer, "fs"):
        raise RuntimeError(
            f"this torch ({torch.__version__}) FileSystemWriter has no 'fs' attribute; shardline's hashing "
            "checkpoint writer needs updating for it (see shardline/_torch_compat.py)"
        )
    writer.fs = filesystem


def _crc32_switch_is_per_context() -> bool:
    """Whether this torch keeps an override of ``torch.save``'s CRC-32 switch per context (thread), not per process.

    torch 2.13 made every override of a ``torch.utils`` config a ``ContextVar`` per entry; torch 2.11 keeps one
    value for the whole process. Read from the entry's structure, so the check changes nothing.
    """
    from torch.utils.serialization import config

    entries = getattr(config, "_config", None)
    entry = entries.get("save.compute_crc32") if isinstance(entries, dict) else None
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


SAVE_CRC32_PER_CONTEXT: bool = _crc32_switch_is_per_context()
"""Whether :func:`skip_save_crc32_here` can switch ``torch.save``'s CRC-32 off for one thread alone (torch >= 2.13)."""


def skip_save_crc32_here() -> bool:
    """Make ``torch.save`` in the calling thread's context skip the CRC-32 of its records; whether it could.

    Note: why shardline's writer skips it. ``torch.save`` computes a CRC-32 of every record it
    writes (about 0.35 ms per MiB on the reference CPU: 70 ms of a 192 MiB save's CPU) and no
    reader checks it: ``torch.load`` loads a record with a flipped byte without a word. The
    SHA-256 shardline computes of every file covers the same bytes and is checked by every
    verified load, so the CRC is work for nothing, and on two cores it is the time the hash
    needs. A record without it carries zeros in its CRC fields and loads with ``torch.load``
    of every release (torch documents the switch: ``torch.serialization.set_crc32_options``).
    Only the writer's own threads change: on torch 2.13 and later an override holds for one
    context (:data:`SAVE_CRC32_PER_CONTEXT`). On torch 2.11 the switch is one per process, and
    turning it off would change every other thread's ``torch.save`` too: there this returns
    False and changes nothing, and the records carry their CRC-32 as plain DCP's do.
    """
    if not SAVE_CRC32_PER_CONTEXT:
        return False
    from torch.utils.serialization import config

    if config.save.compute_crc32:
        config.save.compute_crc32 = False
    return True


def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout collectives of ``group`` (default: the world) run under, or None if unknown."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        return None
    timeout: timedelta | None
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        try:
            timeout = group._get_backend(torch.device("cuda")).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            timeout = None
    return timeout


@contextlib.contextmanager
def fake_tensor_mode() -> Iterator[None]:
    """Tensors created inside carry shapes, dtypes and devices but no data (torch's FakeTensorMode).

    Unlike the meta device, fake CPU/CUDA tensors dispatch to the kernels the real device would
    pick (e.g. CPU flash attention, which saves far less for backward than the math path), so
    a dry run measures what a real step would hold.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def dtensor_with_local(dtensor: DTensor, *, local: torch.Tensor) -> DTensor:
    """A DTensor with ``dtensor``'s mesh, placements and global shape whose local piece is ``local``, as it is.

    Note: ``DTensor.from_local`` moves a local piece to the mesh's device type, so a host copy
    of a CUDA shard would go straight back to the GPU. DCP plans a DTensor's write from its spec
    and reads the bytes through ``to_local()``, so a DTensor whose piece stays on the host is what
    an async save hands it (torch's own CPU staging builds the same thing through ``_local_tensor``).
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, dtensor._spec, requires_grad=False)


def storage_key(tensor: torch.Tensor) -> int:
    """An identity for the storage behind ``tensor`` (shared by its views), valid for fake tensors too."""
    key: int = tensor.untyped_storage()._cdata
    return key


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's autograd version counter: it grows with every in-place write through the tensor or its views.

    ``Tensor._version`` is documented in autograd's notes on in-place correctness checks but
    has no public accessor.
    """
    return tensor._version


def profiling_enabled() -> bool:
    """Whether the autograd profiler (``torch.profiler``) is recording right now."""
    return torch.autograd.profiler._is_profiler_enabled


# Note: what a DCP ``.metadata`` pickle may name. torch writes ``.metadata`` with ``pickle``; the
# objects in it are plain dataclasses and enums of ``torch.distributed.checkpoint.metadata``, the
# file-system reader's ``_StorageInfo``/``_StoragePrefix`` records, ``torch.Size``, dtypes and
# the layout helper ``torch.serialization._get_layout`` (and path objects). shardline unpickles it with an
# allowlist of exactly these (see ``checkpoint.dcp_io.unpickle_metadata``), so even a
# ``.metadata`` whose hash was checked against an anchor the attacker also controls cannot run
# code. A torch version that pickles another class there makes the load fail with its name.
DCP_METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "collections": frozenset({"OrderedDict"}),
    # ``StorageMeta.checkpoint_id`` is a path object when DCP was given one
    "pathlib": frozenset({"Path", "PosixPath", "PurePath", "PurePosixPath", "PureWindowsPath", "WindowsPath"}),
}


def is_dcp_metadata_global(module: str, name: str) -> bool:
    """Whether a ``.metadata`` pickle may refer to ``module.name`` (the allowlist above, plus torch dtypes)."""
    return name in DCP_METADATA_CLASSES.get(module, ()) or _is_torch_dtype(module, name)


def _is_torch_dtype(module: str, name: str) -> bool:
    """Whether ``module.name`` is a dtype (pickles name dtypes as ``torch.float32`` and the like)."""
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


# Note: what the ``data.pkl`` of a ``torch.save``'d plain dense tensor names (see
# ``checkpoint.tensor_record``): one of two rebuild functions, a storage class (typed, e.g.
# ``torch.FloatStorage``, or ``torch.storage.UntypedStorage`` with the dtype passed to the v3
# rebuild), a dtype, and an empty ``OrderedDict`` of backward hooks. A torch version that writes
# anything else makes that decoder step aside for ``torch.load``; nothing breaks.
_TENSOR_PICKLE_GLOBALS: dict[tuple[str, str], str] = {
    ("torch._utils", "_rebuild_tensor_v2"): "rebuild_v2",
    ("torch._utils", "_rebuild_tensor_v3"): "rebuild_v3",
    ("collections", "OrderedDict"): "ordered_dict",
    ("torch.storage", "UntypedStorage"): "untyped_storage",
    ("torch", "UntypedStorage"): "untyped_storage",
}


def tensor_pickle_global(module: str, name: str) -> str | None:
    """The role of ``module.name`` in a plain tensor's ``torch.save`` pickle, or None if it has none there.

    Roles: ``rebuild_v2``, ``rebuild_v3``, ``ordered_dict``, ``untyped_storage``, ``typed_storage``, ``dtype``.
    """
    role = _TENSOR_PICKLE_GLOBALS.get((module, name))
    if role is not None:
        return role
    if _is_torch_dtype(module, name):
        return "dtype"
    if module == "torch" and name.endswith("Storage") and typed_storage_dtype(name) is not None:
        return "typed_storage"
    return None


@functools.cache
def typed_storage_dtype(name: str) -> torch.dtype | None:
    """The dtype of the legacy typed storage class ``torch.<name>`` (e.g. ``FloatStorage``), or None."""
    cls = getattr(torch, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.storage.TypedStorage)):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "TypedStorage is deprecated": only its dtype is read
        dtype = getattr(cls, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def elastic_launch_config(**kwargs: Any) -> LaunchConfig:
    """A ``torch.distributed.launcher.api.LaunchConfig``, leaving out fields this torch does not have.

    ``shutdown_timeout`` (how long the agent waits after ``SIGTERM`` before ``SIGKILL``) appeared
    after torch 2.6; older versions wait their fixed 30 s.
    """
    from torch.distributed.launcher.api import LaunchConfig

    known = LaunchConfig.__dataclass_fields__
    return LaunchConfig(**{k: v for k, v in kwargs.items() if k in known})


def fsspec_storage(*, reader: bool) -> type[FsspecReader] | type[FsspecWriter]:
    """torch DCP's fsspec ``FsspecReader`` (``reader=True``) or ``FsspecWriter`` class.

    torch 2.13 keeps them in the private module ``torch.distributed.checkpoint._fsspec_filesystem``
    (``dcp.save(checkpoint_id="s3://...")`` picks the writer itself, but with ``sync_files=True``,
    which on an object store falls back to a machine-wide ``os.sync()``). The benchmarks compare
    against them as plain DCP on an object store.
    """
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem.FsspecReader if reader else _fsspec_filesystem.FsspecWriter


def fsdp2_settings(module: object) -> tuple[bool | int | None, Any]:
    """``(reshard_after_forward, mixed-precision policy)`` of a module ``fully_shard`` was applied to.

    ``reshard_after_forward`` is ``True`` / ``False`` / the size of the smaller post-forward
    shard group, or ``None`` where the module holds no parameters of its own. FSDP2 has setters
    for both but no getters: they are read from its per-module state.
    """
    state = module._get_fsdp_state()  # type: ignore[attr-defined]
    policy = getattr(state, "_mp_policy", None)
    group = getattr(state, "_fsdp_param_group", None)
    if group is None:
        return None, policy
    post = group.post_forward_mesh_info
    if post is None:
        return False, policy
    size = int(post.shard_mesh_size)
    return (True if size == int(group.mesh_info.shard_mesh_size) else size), policy


def parameter_fqns(model: torch.nn.Module) -> set[str]:
    """The state-dict keys of ``model``'s parameters as torch's state-dict API names them (no wrapper prefixes)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return {fqn for name, _ in model.named_parameters() for fqn in _get_fqns(model, name)}


def is_sharded_tensor(value: object) -> bool:
    """Whether ``value`` is a ``ShardedTensor`` (the pieces of FSDP1's sharded state dict without a device mesh)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    return isinstance(value, ShardedTensor)


def sharded_tensor_local_bytes(value: Any) -> int:
    """Bytes of this rank's shards of a ``ShardedTensor`` (most tensor methods are not defined on one)."""
    return sum(shard.tensor.numel() * shard.tensor.element_size() for shard in value.local_shards())


def dtensor_local_bytes(value: DTensor) -> int:
    """Bytes of a DTensor's local piece, without ``to_local()``'s autograd node (a save sums thousands of them)."""
    local = getattr(value, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):  # a torch without the attribute: the public way
        local = value.to_local()
    return local.numel() * local.element_size()


TORCH_PLAN_CHECK_FAILED = "torch's plan check failed (this torch logs the problems instead of returning them)"
"""What :func:`torch_validate_global_plan` returns for an invalid plan where torch's check answers only a bool."""


def torch_validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """torch DCP's own check of a global save plan (``default_planner._validate_global_plan``): its error messages.

    torch 2.13 returns the messages; torch 2.11 and 2.12 return a bool and log them: there an invalid plan gives
    ``[TORCH_PLAN_CHECK_FAILED]``.
    """
    result: list[str] | bool = default_planner._validate_global_plan(global_plan, metadata)
    if isinstance(result, bool):
        return [] if result else [TORCH_PLAN_CHECK_FAILED]
    return list(result)


class ValidatingSavePlanner(DefaultSavePlanner):
    """torch DCP's ``DefaultSavePlanner`` whose global-plan check is :meth:`validate_global_plan`.

    Note: ``DefaultSavePlanner.create_global_plan`` (rank 0) builds the global plan and metadata
    in the private ``_create_global_plan`` and validates them there with the module function
    ``_validate_global_plan``; there is no hook for the check alone. This override makes the
    same calls into torch's code in the same order (deduplicate the plans, build plan and
    metadata, merge the flattening mappings) and only the validation is replaced; a failed
    check raises ``ValueError`` with torch's message form, which DCP turns into its collective
    ``CheckpointException`` on every rank. Plan caching (``enable_plan_caching``) calls this
    method too. The default here is torch's own check; subclasses override it.
    """

    def validate_global_plan(self, global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
        """The problems of ``global_plan`` and ``metadata`` (empty: valid); torch's own check by default."""
        return torch_validate_global_plan(global_plan, metadata)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        deduped = self._dedup_save_plans(all_plans)
        global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(collections.ChainMap(*(p.planner_data for p in global_plan)))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = self.validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata


def take_pre_2_4_keys(planner: DefaultLoadPlanner) -> None:
    """The first step of ``DefaultLoadPlanner.create_local_plan``: a checkpoint saved by torch <= 2.3 (whose flat
    keys nest differently) gets the state dict flattened the way it was saved.

    Note: torch keeps this step inside ``create_local_plan``, before the module function that plans
    the reads; shardline's load planner replaces only the latter, so it takes the step from here. It
    is torch's rule: keys of the checkpoint missing from the state dict that the 2.3 flattening
    produces mean an old checkpoint (``_version._derived_version`` selects that flattening).
    """
    metadata = planner.metadata
    if metadata is None:
        raise AssertionError("the load planner was not set up with the checkpoint's metadata")
    missing = set(metadata.state_dict_metadata) - set(planner.state_dict)
    if not missing:
        return
    _version._derived_version = "2_3"
    try:
        old_state_dict, old_mappings = flatten_state_dict(planner.original_state_dict)
    finally:
        _version._derived_version = None
    if set(old_state_dict) & missing:
        planner.state_dict, planner.mappings = old_state_dict, old_mappings


def local_chunks(value: Any) -> list[ChunkStorageMetadata]:
    """The chunks of a tensor this rank holds, as DCP's planners see them (a DTensor's piece, a ShardedTensor's
    local shards, or a whole plain tensor).

    Raises:
        ValueError: ``value`` is not a tensor DCP can load into.
    """
    chunks: list[ChunkStorageMetadata] = planner_helpers._create_chunk_list(value)
    return chunks


def read_items_by_torch(fqn: str, saved: TensorStorageMetadata | BytesStorageMetadata, value: Any) -> list[ReadItem]:
    """torch DCP's read items for one state-dict entry (its resharding planner, as ``DefaultLoadPlanner`` runs it)."""
    items: list[ReadItem] = planner_helpers._create_read_items(fqn, saved, value)
    return items


def _private_api_problems() -> list[str]:
    """The private torch APIs used above that this torch lacks (only those ``import torch`` loads)."""
    from torch.distributed.tensor import DTensor

    checks: dict[str, Callable[[], object]] = {
        "torch._C._current_graph_task_id": lambda: torch._C._current_graph_task_id,
        "torch.autograd.Variable._execution_engine.queue_callback": (
            lambda: torch.autograd.Variable._execution_engine.queue_callback
        ),
        "torch.autograd.profiler._is_profiler_enabled": lambda: torch.autograd.profiler._is_profiler_enabled,
        "torch.Tensor._version": lambda: torch.Tensor._version,
        "torch.UntypedStorage._cdata": lambda: torch.UntypedStorage._cdata,
        "DTensor._spec": lambda: DTensor._spec,
        "torch.distributed.checkpoint.default_planner._validate_global_plan": (
            lambda: default_planner._validate_global_plan
        ),
        "DefaultSavePlanner._create_global_plan": lambda: DefaultSavePlanner._create_global_plan,
        "DefaultSavePlanner._dedup_save_plans": lambda: DefaultSavePlanner._dedup_save_plans,
        "torch.distributed.checkpoint._version._derived_version": lambda: _version._derived_version,
        "torch.distributed.checkpoint.planner_helpers._create_chunk_list": lambda: planner_helpers._create_chunk_list,
        "torch.distributed.checkpoint.planner_helpers._create_read_items": lambda: planner_helpers._create_read_items,
    }
    problems = []
    for name, read in checks.items():
        try:
            read()
        except (AttributeError, KeyError, TypeError, ValueError):
            problems.append(f"{name} is missing")
    return problems


def _check_installed() -> None:
    """The installed torch against :data:`SUPPORTED_TORCH` and the private APIs shardline uses.

    Raises:
        ConfigurationError: one message naming every problem, the installed torch and the supported range.
    """
    installed = torch.__version__
    problems = (
        [f"torch {installed} is older than {_TORCH_FLOOR}"] if installed < _TORCH_FLOOR else _private_api_problems()
    )
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigurationError(
            f"shardline does not support the installed torch {installed}:\n{listed}\n"
            f"shardline supports torch {SUPPORTED_TORCH}: install a release in that range "
            f"(pip install 'torch{SUPPORTED_TORCH}'), or a shardline release that supports torch {installed}."
        )


_check_installed()  # once, at the first import (import shardline)
