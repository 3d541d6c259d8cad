"""What a save writes: the typed request, and the state captured from it at one instant.

:class:`SaveRequest` is the one description of a save (model, step, optimizer, trainer state,
config, data fingerprint, kind, tag), validated once when it is made; ``save``,
``CheckpointManager.save`` and the capture below all take it instead of repeating the
arguments. :func:`capture` turns it into a :class:`CapturedCheckpoint`: the DCP state dict plus
everything the manifest records. (An async save's capture copies the state into host buffers,
which is what "staged" means elsewhere: :mod:`.host_buffers`.)
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardline import _torch_compat
from shardline.checkpoint.coordination import coord
from shardline.checkpoint.format.canonical import config_hash
from shardline.checkpoint.format.dcp_io import CONFIG_KEY, MODEL_KEY, OPTIM_KEY, PER_RANK_KEY, TRAINER_KEY, encode_state
from shardline.checkpoint.format.hf_export import hf_metadata
from shardline.checkpoint.format.packed_layout import DEFAULT_SEGMENT_BYTES, CheckpointLayout, holds_packable
from shardline.checkpoint.integrity.copy_check import StagedDigester, StagedTensor
from shardline.checkpoint.integrity.manifest import describe_units
from shardline.checkpoint.lifecycle.host_buffers import HostBuffers
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.checkpoint.state.engines import describe_sharding, describe_torch_state, detect_engine, torch_state
from shardline.checkpoint.state.model_state import SAVE_KINDS, SaveKind, model_state_dict, param_index
from shardline.checkpoint.state.optim_state import optimizer_state_dict
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate
from shardline.engine._checkpoint_support import buffer_original_dtypes, registered_state_dict
from shardline.errors import ConfigurationError

__all__ = [
    "SAVE_KINDS",
    "CapturedCheckpoint",
    "SaveKind",
    "SaveRequest",
    "capture",
    "check_layout_options",
    "describe_model",
    "dtype_name",
]

TAG_PATTERN = re.compile(r"^[a-z0-9_]+$")
log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """One checkpoint to save: what goes in it and what the manifest records about it.

    Attributes:
        model: The (sharded) model.
        step: Training step recorded in the manifest (a non-negative int).
        optimizer: Its optimizer, saved keyed by parameter FQN.
        state: Trainer state: tensors, numbers, strings, bytes, None and nested dicts/lists/tuples.
            Entries are taken from rank 0, except ``state["per_rank"]``, which every rank saves
            under its own key (RNG states, data position...) and gets back from ``load``.
        config: The resolved training config (plain JSON data); stored and hashed canonically.
        data_fingerprint: A string identifying the training data, recorded in the manifest.
        kind: ``"sharded"`` (each rank writes its shards; reshardable) or ``"full"`` (gathered, rank 0 writes).
        tag: Recorded in the manifest and, under a manager, in the directory name (``[a-z0-9_]+``).
        run_tags: ``{key: value}`` strings a team files the run under (ticket, owner...), recorded in the
            manifest and the provenance statement (:mod:`..provenance.run_tags`).
        metrics: What the run measured at ``step`` (``{"val_loss": 2.31}``): a
            :class:`~shardline.checkpoint.CheckpointManager` records them in the checkpoint's commit
            row, where best-k retention (``keep_best_k``, ``monitor``) and ``shardline lineage`` read them.
        layout: How a sharded save stores its tensors (a ``CheckpointLayout`` or its name): ``"per_tensor"``
            (DCP's chunk per rank and tensor) or ``"packed"`` (each rank's row shards in a few segments, for
            thousands of ranks; docs/checkpoint-protocol.md). None: the manager's layout, else ``per_tensor``. A
            ``full`` save has nothing to pack and refuses ``"packed"``.
        segment_bytes: The packed layout's segment size (None: the manager's, else 256 MiB).
    """

    model: nn.Module
    step: int
    optimizer: torch.optim.Optimizer | None = None
    state: Mapping[str, Any] | None = None
    config: Mapping[str, Any] | None = None
    data_fingerprint: str | None = None
    kind: SaveKind = "sharded"
    tag: str | None = None
    run_tags: Mapping[str, str] | None = None
    metrics: Mapping[str, float] | None = None
    layout: CheckpointLayout | str | None = None
    segment_bytes: int | None = None

    def __post_init__(self) -> None:
        check_run_tags(self.run_tags, where="run_tags")
        check_layout_options(self.layout, self.segment_bytes, kind=self.kind)
        if self.kind not in SAVE_KINDS:
            raise ConfigurationError(
                f"checkpoints are saved with kind 'sharded' (default; reshardable) or 'full' (gathered on rank 0), "
                f"got {self.kind!r}; 'local' state dicts are for in-memory debugging only"
            )
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ConfigurationError(f"step must be a non-negative int, got {self.step!r}")
        if self.data_fingerprint is not None and not isinstance(self.data_fingerprint, str):
            raise ConfigurationError(
                f"data_fingerprint must be a string or None, got {type(self.data_fingerprint).__name__}"
            )
        if self.tag is not None and (not isinstance(self.tag, str) or not TAG_PATTERN.match(self.tag)):
            raise ConfigurationError(f"checkpoint tag must match [a-z0-9_]+, got {self.tag!r}")
        for name, value in (self.metrics or {}).items():
            if not isinstance(name, str) or not name or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigurationError(
                    f"metrics must map metric names to numbers (e.g. {{'val_loss': 2.31}}), got {name!r}: {value!r}"
                )


def check_layout_options(layout: CheckpointLayout | str | None, segment_bytes: int | None, *, kind: str) -> None:
    """A request's layout options: a known layout, a positive segment size, and no packed ``full`` save."""
    if layout is not None and CheckpointLayout.parse(layout) is CheckpointLayout.PACKED and kind == "full":
        raise ConfigurationError(
            "layout='packed' stores each rank's shards of sharded tensors; a kind='full' save gathers every tensor "
            "on rank 0, so there is nothing to pack: save kind='full' with layout='per_tensor' (the default)"
        )
    if segment_bytes is not None and (
        isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes <= 0
    ):
        raise ConfigurationError(f"segment_bytes must be a positive number of bytes, got {segment_bytes!r}")


@dataclass(frozen=True)
class CapturedCheckpoint:
    """Everything a save writes, captured at one instant (see :func:`capture`)."""

    final: Location
    step: int
    tag: str | None
    kind: str
    world_size: int
    state_dict: dict[str, Any]
    units: list[dict[str, Any]]
    model_info: dict[str, Any]
    contents: dict[str, bool]
    config_sha256: str | None
    data_fingerprint: str | None
    parent_manifest_hash: str | None
    total_bytes: int = 0
    """Bytes of tensor and object data all ranks write (what the write needs on disk, before DCP's framing)."""
    extra: dict[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] | None = None
    """The resolved training config (recorded in the provenance statement)."""
    staged_digests: Mapping[tuple[str, int], StagedTensor] | None = None
    """For a copied (async) save: this rank's staged tensors by storage, each with the SHA-256 of its bytes
    (:mod:`.copy_check`); the write checks the bytes in the files against them."""
    source_device: torch.device | None = None
    """For a copied (async) save: the accelerator device the staged tensors came from (the writer thread makes
    it current), or None when they came from the host."""
    sharding: dict[str, Any] = field(default_factory=dict)
    """The manifest's ``sharding`` section: the engine that sharded the model and how (:mod:`..state.engines`)."""
    run_tags: dict[str, str] = field(default_factory=dict)
    """The request's run tags (recorded in the manifest and the statement only when there are some)."""
    layout: CheckpointLayout = CheckpointLayout.PER_TENSOR
    """How the tensors are stored (recorded in the manifest's ``sharding`` section when packed)."""
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    """The packed layout's segment size."""


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def describe_model(model: nn.Module) -> dict[str, Any]:
    """What the manifest records about the model: counts, tied and 0-d names, and every key's shape and dtype.

    ``state`` maps each state-dict key to ``[shape, dtype]`` as a model built from the same
    config has them before sharding (the global shape; ``[]`` for 0-d), so a launcher can check
    that a model fits a checkpoint without opening the checkpoint's data files.
    """
    index = param_index(model)
    cast_buffers = buffer_original_dtypes(model)
    groups: dict[int, list[str]] = {}
    scalars: list[str] = []
    state: dict[str, list[Any]] = {}
    params = 0
    for key, value in registered_state_dict(model).items():
        found = index.get(id(value))
        if found is not None:
            shape, dtype = found.shape, found.dtype
        else:
            shape, dtype = tuple(value.shape), cast_buffers.get(id(value), value.dtype)
        state[key] = [list(shape), dtype_name(dtype)]
        ident = id(found.shard) if found else id(value)
        groups.setdefault(ident, []).append(key)
        if len(groups[ident]) > 1:
            continue
        if found is not None or isinstance(value, nn.Parameter):
            params += int(torch.Size(shape).numel())
            if shape == ():
                scalars.append(key)
    return {
        "tensors": sum(len(keys) for keys in groups.values()),
        "parameters": params,
        "tied": [keys for keys in groups.values() if len(keys) > 1],
        "scalars": scalars,
        "state": state,
    }


def _same_bytes(obj: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a tensor's bytes, so two state-dict entries of one tensor (tied weights) stage once."""
    t = obj.to_local() if isinstance(obj, DTensor) else obj
    where = (str(t.device), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
    if isinstance(obj, DTensor):
        return (*where, tuple(obj.placements), tuple(obj.shape))
    return where


def _snapshot(
    obj: Any,
    *,
    on_copy: Callable[[torch.Tensor], None],
    buffers: HostBuffers,
    memo: dict[tuple[Any, ...], Any] | None = None,
) -> Any:
    """A host copy of every tensor in ``obj`` (DTensor pieces keep their placement) so training can go on.

    Each tensor (the local piece of a DTensor) is copied once, into a buffer of ``buffers``
    (:mod:`.host_buffers`: on the host, never on the model's device), and ``on_copy`` gets the
    copy as soon as it is made. Entries holding the same bytes (tied weights) share one copy.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, dict):
        return {k: _snapshot(v, on_copy=on_copy, buffers=buffers, memo=memo) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v, on_copy=on_copy, buffers=buffers, memo=memo) for v in obj]
    if not isinstance(obj, torch.Tensor):
        return obj
    key = _same_bytes(obj)
    if obj.numel() and key in memo:
        return memo[key]
    copied: torch.Tensor
    if isinstance(obj, DTensor):
        local = buffers.copy(obj.to_local())
        on_copy(local)
        copied = _torch_compat.dtensor_with_local(obj, local=local)
    else:
        copied = buffers.copy(obj)
        on_copy(copied)
    memo[key] = copied
    return copied


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu(v) for v in obj)
    return obj


def _local_bytes(obj: Any) -> int:
    """Bytes this rank writes for ``obj``: local shard data of tensors, the length of byte strings."""
    if isinstance(obj, DTensor):
        return _torch_compat.dtensor_local_bytes(obj)
    if _torch_compat.is_sharded_tensor(obj):
        return _torch_compat.sharded_tensor_local_bytes(obj)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, str)):
        return len(obj)
    if isinstance(obj, Mapping):
        return sum(_local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_bytes(v) for v in obj)
    return 0


def _config_text(config: Mapping[str, Any]) -> str:
    config_hash(config)  # validates: plain JSON-able data only
    return json.dumps(config, sort_keys=True, ensure_ascii=False)


def capture(
    request: SaveRequest,
    *,
    path: str | os.PathLike[str] | Location,
    parent_manifest_hash: str | None = None,
    copy: bool = False,
    buffers: HostBuffers | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> CapturedCheckpoint:
    """Capture what the save of ``request`` into ``path`` writes (this rank's part).

    With ``copy=False`` the state dict references the live shards (no copy; write before
    training changes them). With ``copy=True`` tensors are copied to host memory, into
    ``buffers`` (reused across saves; the previous save's write must have ended) or fresh ones,
    so training may continue while a background thread writes. Kind ``full`` gathers (a
    collective on the default group).
    ``total_bytes`` is this rank's share here; ``save.capture_agreed`` sums it over the ranks.
    """
    rank = coord.group_rank(process_group)
    model, kind = request.model, request.kind
    trainer = dict(request.state or {})
    per_rank = trainer.pop("per_rank", None)
    for key, value in hf_metadata(model).items():  # transformers / PEFT configs, for consolidate
        trainer.setdefault(key, value)
    engine = detect_engine(model)
    sd: dict[str, Any] = {}
    if engine.uses_torch_state_dict:
        model_sd, optim_sd = torch_state(model, request.optimizer, full=kind == "full")
        sd[MODEL_KEY] = model_sd
        if optim_sd is not None:
            sd[OPTIM_KEY] = optim_sd
        model_info = describe_torch_state(model, model_sd)
    else:
        sd[MODEL_KEY] = model_state_dict(model, kind=kind)
        if request.optimizer is not None:
            sd[OPTIM_KEY] = optimizer_state_dict(model, request.optimizer, kind=kind)
        model_info = describe_model(model)
    # Note: only rank 0 contributes the shared trainer state and the config. DCP stores an item
    # that several ranks hold under the same key once, from whichever rank it picks; keeping it
    # on one rank makes "taken from rank 0" the rule instead of an accident.
    if rank == 0:
        sd[TRAINER_KEY] = encode_state(_cpu(trainer), "trainer state")
        if request.config is not None:
            sd[CONFIG_KEY] = _config_text(request.config)
    if per_rank is not None:
        sd[PER_RANK_KEY] = {str(rank): encode_state(_cpu(per_rank), f"per-rank trainer state of rank {rank}")}
    digester = StagedDigester() if copy else None
    source_device: torch.device | None = None
    if digester is not None and kind == "sharded":
        _refuse_sharded_tensors(sd)
        buffers = buffers if buffers is not None else HostBuffers()
        buffers.begin()
        sd = _snapshot(sd, on_copy=digester.add, buffers=buffers)
        buffers.finish()
        source_device = buffers.source_device
    requested = CheckpointLayout.parse(request.layout or CheckpointLayout.PER_TENSOR)
    layout = requested
    segment_bytes = request.segment_bytes or DEFAULT_SEGMENT_BYTES
    # Note: a packed save of a state with no packable DTensor (a model the engine does not shard, or only
    # other placements) would write an empty table and a manifest saying "packed" over what is a per-tensor
    # checkpoint. It is stored per tensor -- plain DCP, which any reader loads -- and recorded as such.
    if requested is CheckpointLayout.PACKED and not holds_packable(sd):
        layout = CheckpointLayout.PER_TENSOR
        if rank == 0:
            log.warning(
                "checkpoint %s: layout='packed' was asked for, but its state holds no DTensor the packed layout "
                "stores (at least 1-D, placed Replicate() and at most one Shard(0)); saving it per tensor, and "
                "its manifest records layout 'per_tensor'",
                locate(path),
            )
    sharding = describe_sharding(model, engine)
    if layout is CheckpointLayout.PACKED:
        sharding = {**sharding, "layout": layout.value, "segment_bytes": segment_bytes}
    elif requested is CheckpointLayout.PACKED:
        sharding = {**sharding, "layout": layout.value}
    return CapturedCheckpoint(
        final=locate(path),
        step=request.step,
        tag=request.tag,
        kind=kind,
        world_size=coord.group_size(process_group),
        state_dict=sd,
        units=describe_units(model),
        model_info=model_info,
        contents={
            "model": True,
            "optimizer": request.optimizer is not None,
            "trainer_state": True,
            "per_rank_state": per_rank is not None,
            "config": request.config is not None,
        },
        config_sha256=config_hash(request.config) if request.config is not None else None,
        data_fingerprint=request.data_fingerprint,
        parent_manifest_hash=parent_manifest_hash,
        total_bytes=_local_bytes(sd),
        config=request.config,
        staged_digests=digester.digests(sd) if digester is not None else None,
        source_device=source_device,
        sharding=sharding,
        run_tags=check_run_tags(request.run_tags),
        layout=layout,
        segment_bytes=segment_bytes,
    )


def _refuse_sharded_tensors(sd: Mapping[str, Any]) -> None:
    """An async save copies tensors and DTensor pieces; FSDP1's ShardedTensor pieces it cannot copy."""
    for key, value in sd.get(MODEL_KEY, {}).items():
        if _torch_compat.is_sharded_tensor(value):
            raise ConfigurationError(
                f"model entry {key!r} is a ShardedTensor (FullyShardedDataParallel without device_mesh): an async "
                "save cannot copy it to host memory. Save synchronously, or build FullyShardedDataParallel with "
                "device_mesh=init_device_mesh(...) so its state dict holds DTensors"
            )
