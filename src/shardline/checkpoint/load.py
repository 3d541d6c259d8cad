"""``load``: check a checkpoint, then load it into a model of any world size and strategy.

Note: how resharding works. Every parameter target is the live shard exposed as a DTensor
piece (``ManagedParam.to_dtensor``, no copy); DCP's planner intersects the pieces each rank asks for
with the chunks each file holds and reads exactly the overlapping rows into the shards in
place. So W -> W' and FULL_SHARD <-> NO_SHARD (a ``Replicate`` piece asks for all rows) need
no gather, and a checkpoint saved with kind ``full`` (one chunk per tensor) loads the same way.

Note: optimizer state is initialized from the checkpoint's own metadata, not by a dummy
optimizer step: for each ``optim.state.<fqn>.<name>`` item we allocate an empty tensor shaped
like this rank's shard (elementwise state, as a DTensor piece placed like the parameter) or a
0-d tensor (scalar state), DCP fills them, and ``Optimizer.load_state_dict`` installs them
(casting as torch does). No hyperparameter is touched and nothing depends on the optimizer's
update rule.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardline.checkpoint import coord
from shardline.checkpoint.dcp_io import (
    CONFIG_KEY,
    MODEL_KEY,
    OPTIM_KEY,
    PER_RANK_KEY,
    TRAINER_KEY,
    CachedReader,
    SafeLoadPlanner,
    build_tree,
    decode_state,
    key_paths,
    read_metadata,
    subtree,
)
from shardline.checkpoint.fsutil import is_tmp_name
from shardline.checkpoint.manifest import DCP_METADATA, MANIFEST, manifest_files, read_manifest
from shardline.checkpoint.model_state import param_index
from shardline.checkpoint.optim_state import load_optimizer_state_dict, optimizer_params
from shardline.checkpoint.verify import check_files
from shardline.engine import key_problems, registered_state_dict, release_all
from shardline.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWarning,
    ConfigurationError,
    IntegrityError,
)

__all__ = ["VERIFY_LEVELS", "check_checkpoint", "load", "load_config", "load_trainer_state"]

VERIFY_LEVELS = ("manifest", "full", "none")
_SHOW = 10
_ERRORS: dict[str, type[CheckpointError]] = {
    "CheckpointNotFoundError": CheckpointNotFoundError,
    "IntegrityError": IntegrityError,
    "CheckpointMismatchError": CheckpointMismatchError,
}


def _raise_remote(error: dict[str, str]) -> None:
    raise _ERRORS.get(error["type"], CheckpointError)(error["message"])


def _check_on_rank0(path: Path, verify: str) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a checkpoint: no such directory")
    if is_tmp_name(path.name):
        raise CheckpointNotFoundError(
            f"{path} is the temporary directory of a save that never committed (interrupted or failed); it may be "
            "incomplete and must not be loaded. Load a committed checkpoint (a step-N directory) instead."
        )
    if not (path / MANIFEST).is_file():
        if not (path / DCP_METADATA).is_file():
            raise CheckpointNotFoundError(
                f"{path} is not a checkpoint: it has neither {MANIFEST} nor {DCP_METADATA} "
                f"(contents: {', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'empty'})"
            )
        if verify == "full":
            raise IntegrityError(
                f"{path} is a plain torch.distributed.checkpoint directory without a shardline manifest, so "
                "verify='full' cannot check it; load it with verify='manifest' or 'none' (it has no lineage)"
            )
        return {"manifest": None}
    manifest, digest = read_manifest(path)
    if verify != "none":
        problems, _ = check_files(path, manifest_files(manifest), "manifest")
        if problems:
            listing = "; ".join(f"{p.path}: {p.kind} ({p.detail})" for p in problems[:_SHOW])
            raise IntegrityError(
                f"checkpoint {path} does not match its manifest -- {listing}. Run `shardline verify {path}` for a "
                "full report; load another checkpoint."
            )
    return {"manifest": manifest, "hash": digest}


def check_checkpoint(
    path: str | os.PathLike, *, verify: str = "manifest", process_group: dist.ProcessGroup | None = None
) -> dict[str, Any] | None:
    """Check the checkpoint before loading (a collective); return its manifest, or None for plain DCP.

    ``manifest``: manifest hash, every file present with its size. ``full``: also re-hash every
    file, spread over the ranks. ``none``: only that it is a checkpoint. A plain DCP directory
    (no manifest) passes with a :class:`CheckpointWarning` on rank 0 (except under ``full``).

    Raises:
        CheckpointNotFoundError, IntegrityError: on every rank.
    """
    if verify not in VERIFY_LEVELS:
        raise ConfigurationError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, got {verify!r}")
    path = Path(path)
    verdict: dict[str, Any] = {}
    rank = coord.group_rank(process_group)
    if rank == 0:
        try:
            verdict = _check_on_rank0(path, verify)
        except CheckpointError as e:
            verdict = {"error": {"type": type(e).__name__, "message": str(e)}}
    verdict = coord.broadcast_object(verdict, process_group)
    if "error" in verdict:
        _raise_remote(verdict["error"])
    manifest = verdict["manifest"]
    if manifest is None:
        if rank == 0:
            warnings.warn(
                f"{path} is a plain torch.distributed.checkpoint directory without a shardline manifest: it has no "
                "lineage and its files cannot be verified; loading it anyway",
                CheckpointWarning,
                stacklevel=3,
            )
        return None
    if verify == "full":
        world = coord.group_size(process_group)
        mine = manifest_files(manifest)[rank::world]
        problems, _ = check_files(path, mine, "full")
        found = coord.all_gather_object([f"{p.path}: {p.kind} ({p.detail})" for p in problems], process_group)
        flat = [p for per_rank in found for p in per_rank]
        if flat:
            raise IntegrityError(
                f"checkpoint {path} failed full verification -- {'; '.join(flat[:_SHOW])}. Load another checkpoint."
            )
    return manifest


def _mismatch(path: Path, problems: list[str]) -> CheckpointMismatchError:
    shown = "; ".join(problems[:_SHOW]) + (f"; ... ({len(problems) - _SHOW} more)" if len(problems) > _SHOW else "")
    return CheckpointMismatchError(
        f"checkpoint {path} does not fit this model/optimizer -- {shown}. Load it into the model architecture it "
        "was saved from (world size and sharding strategy may differ)."
    )


def _model_targets(
    model: nn.Module, metadata: Metadata, prefix: tuple[Any, ...], strict: bool, problems: list[str]
) -> tuple[dict[str, Any], list[Callable[[], None]]]:
    stored = {path[0]: md for path, md in subtree(metadata, prefix) if len(path) == 1}
    if not prefix:  # a flat (plain DCP) model state dict: tensors at the top level only
        stored = {k: md for k, md in stored.items() if isinstance(md, TensorStorageMetadata)}
    index = param_index(model)
    local = registered_state_dict(model)
    if strict:
        problems += key_problems(local, stored, missing="the checkpoint lacks", unexpected="the model lacks")
    targets: dict[str, Any] = {}
    after: list[Callable[[], None]] = []
    done: set[int] = set()
    for key, value in local.items():
        md = stored.get(key)
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a non-tensor object there")
            continue
        size = tuple(md.size)
        found = index.get(id(value))
        if found is None:
            if size != tuple(value.shape):
                problems.append(f"{key}: checkpoint shape {size} vs model {tuple(value.shape)}")
                continue
            temp = torch.empty(size, dtype=md.properties.dtype)
            targets[key] = temp
            after.append(lambda v=value, t=temp: v.data.copy_(t.to(device=v.device, dtype=v.dtype)))
            continue
        if id(found.shard) in done:
            continue
        if size == found.global_shape:
            targets[key] = found.to_dtensor()
        elif size == () and found.shape == ():
            temp = torch.empty((), dtype=md.properties.dtype)
            targets[key] = temp
            after.append(lambda h=found, t=temp: h.load_full(t))
        else:
            problems.append(f"{key}: checkpoint shape {size} vs model {found.shape}")
            continue
        done.add(id(found.shard))
    return targets, after


def _optim_targets(
    model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata, problems: list[str]
) -> dict[str, Any]:
    entries = subtree(metadata, (OPTIM_KEY,))
    if not entries:
        problems.append("an optimizer was passed but the checkpoint holds no optimizer state ('optim.*' keys)")
        return {}
    by_fqn = {fqn: managed for _, fqn, managed in optimizer_params(model, optimizer)}
    placed = []
    for path, md in entries:
        if not isinstance(md, TensorStorageMetadata):
            placed.append((path, None))
            continue
        if len(path) != 3 or path[0] != "state":
            problems.append(f"optimizer item {'.'.join(map(str, path))} is not in the FQN-keyed layout")
            continue
        fqn, name = path[1], path[2]
        if fqn not in by_fqn:
            problems.append(f"optimizer state for '{fqn}', which this optimizer does not hold")
            continue
        size, dtype, managed = tuple(md.size), md.properties.dtype, by_fqn[fqn]
        if managed is None or size == ():
            placed.append((path, torch.empty(size, dtype=dtype)))
        elif size == managed.global_shape:
            local = torch.empty(managed.local_shape, dtype=dtype, device=managed.shard.device)
            placed.append((path, managed.to_dtensor(local)))
        else:
            problems.append(
                f"optimizer state '{name}' of '{fqn}': checkpoint shape {size} vs parameter {managed.global_shape}"
            )
    return build_tree(placed)


def load(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    verify: str = "manifest",
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) at any world size and strategy (a collective).

    Args:
        path: A committed checkpoint directory (or a plain DCP directory: loads with a warning).
        verify: ``"manifest"`` (default: manifest hash, files present with their sizes),
            ``"full"`` (also re-hash every file, spread over the ranks) or ``"none"``.
        strict: Model keys must match exactly (shapes always must).

    Returns:
        The trainer state saved with it (rank 0's), plus ``"per_rank"``: the entry this rank
        saved, present only if the checkpoint has one for this rank (it was saved with at
        least ``rank + 1`` ranks). Tensors come back on CPU.

    Raises:
        CheckpointNotFoundError: not a (committed) checkpoint.
        IntegrityError: files missing or not matching the manifest.
        CheckpointMismatchError: keys or shapes that do not fit; nothing is loaded then.
    """
    path = Path(path)
    check_checkpoint(path, verify=verify, process_group=process_group)
    reader = CachedReader(path)
    metadata = reader.read_metadata()
    tops = {p[0] for p in key_paths(metadata).values()}
    prefix: tuple[Any, ...] = (MODEL_KEY,) if MODEL_KEY in tops else ()
    problems: list[str] = []
    model_targets, after = _model_targets(model, metadata, prefix, strict, problems)
    targets: dict[str, Any] = {MODEL_KEY: model_targets} if prefix else dict(model_targets)
    if optimizer is not None:
        targets[OPTIM_KEY] = _optim_targets(model, optimizer, metadata, problems)
    rank = coord.group_rank(process_group)
    if TRAINER_KEY in tops:
        targets[TRAINER_KEY] = None
    per_rank = {path[0] for path, _ in subtree(metadata, (PER_RANK_KEY,))}
    if str(rank) in per_rank:
        targets[PER_RANK_KEY] = {str(rank): None}
    # Every rank checked the same metadata against the same model; agree before DCP's collectives.
    verdicts = coord.all_gather_object(problems, process_group)
    if any(verdicts):
        raise _mismatch(path, next(v for v in verdicts if v))
    release_all(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(
            targets,
            storage_reader=reader,
            planner=SafeLoadPlanner(),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    with torch.no_grad():
        for fn in after:
            fn()
    if optimizer is not None:
        load_optimizer_state_dict(model, optimizer, targets[OPTIM_KEY], kind="sharded")
    state = decode_state(targets[TRAINER_KEY]) if targets.get(TRAINER_KEY) is not None else {}
    if not isinstance(state, dict):
        raise IntegrityError(f"checkpoint {path}: the trainer state is a {type(state).__name__}, not a dict")
    if PER_RANK_KEY in targets:
        state["per_rank"] = decode_state(targets[PER_RANK_KEY][str(rank)])
    return state


def load_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The training config stored in a checkpoint (None if it has none). Reads only; no process group needed."""
    metadata = read_metadata(path)
    if CONFIG_KEY not in key_paths(metadata):
        return None
    target: dict[str, Any] = {CONFIG_KEY: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(target, storage_reader=CachedReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return json.loads(target[CONFIG_KEY])


def load_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """The shared trainer state stored in a checkpoint (rank 0's), read offline; ``{}`` if none."""
    metadata = read_metadata(path)
    if TRAINER_KEY not in key_paths(metadata):
        return {}
    target: dict[str, Any] = {TRAINER_KEY: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(target, storage_reader=CachedReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return decode_state(target[TRAINER_KEY])
