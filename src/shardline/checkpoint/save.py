"""``save``: write a checkpoint with DCP, hash it while writing, and commit it atomically.

Note: the commit protocol (a collective over ``process_group``).

1. **Preflight** (rank 0): the final directory must not exist and its parent must be
   creatable and writable; rank 0 creates a hidden temporary directory beside it
   (``.step-100.tmp-<hex>``) and broadcasts the verdict. Every rank then checks it can see and
   write that directory (one small all-gather), so an unwritable or unshared path fails on
   every rank before any data is written.
2. **Write**: ``torch.distributed.checkpoint.save`` with :class:`~.hashing.HashingWriter`:
   each rank writes and fsyncs its ``.distcp`` file, hashing it in the same pass; digests
   reach rank 0 inside the write results DCP gathers; rank 0 writes ``.metadata``.
3. **Manifest** (rank 0): ``manifest.json`` (canonical JSON, so its file hash is the manifest
   hash), ``manifest.sha256`` and ``SHA256SUMS``, each fsynced, then the directory is fsynced.
4. **Commit** (rank 0): ``rename(tmp, final)`` -- atomic on POSIX file systems -- and fsync the
   parent. This is the commit point: a directory with a final name is always complete.
5. **Publish** (rank 0, optional callback): the manager updates ``latest`` and the ledger.
6. Rank 0 broadcasts the outcome; every rank returns the same :class:`CheckpointInfo` or raises.

A crash before step 4 leaves only a hidden temporary directory that nothing resumes from;
the final name is never overwritten (step 1 refuses an existing one, and step 4 re-checks).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from shardline.checkpoint import coord, fault
from shardline.checkpoint.canonical import canonical_json, config_hash, sha256_hex
from shardline.checkpoint.dcp_io import CONFIG_KEY, MODEL_KEY, OPTIM_KEY, PER_RANK_KEY, TRAINER_KEY, encode_state
from shardline.checkpoint.fsutil import fsync_dir, tmp_dir_for
from shardline.checkpoint.hashing import FileDigest, HashingWriter
from shardline.checkpoint.hf_export import hf_metadata
from shardline.checkpoint.manifest import (
    MANIFEST,
    MANIFEST_HASH_FILE,
    SUMS_FILE,
    build_manifest,
    describe_units,
    render_manifest_hash_file,
    render_sums,
)
from shardline.checkpoint.model_state import model_state_dict, param_index
from shardline.checkpoint.optim_state import optimizer_state_dict
from shardline.engine import registered_state_dict
from shardline.errors import CheckpointError, CheckpointExistsError, ConfigurationError

__all__ = ["CheckpointInfo", "StagedCheckpoint", "preflight", "save", "stage", "stage_agreed", "write_and_commit"]

SAVE_KINDS = ("sharded", "full")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as every rank learns it from rank 0 at the end of a save."""

    path: Path
    step: int
    manifest_hash: str
    tag: str | None
    kind: str
    world_size: int
    files: int
    total_bytes: int
    parent_manifest_hash: str | None


@dataclass(frozen=True)
class StagedCheckpoint:
    """Everything a save writes, captured at one instant (see :func:`stage`)."""

    final: Path
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
    extra: dict[str, Any] = field(default_factory=dict)


def _model_info(model: nn.Module) -> dict[str, Any]:
    index = param_index(model)
    groups: dict[int, list[str]] = {}
    scalars: list[str] = []
    params = 0
    for key, value in registered_state_dict(model).items():
        found = index.get(id(value))
        ident = id(found.shard) if found else id(value)
        groups.setdefault(ident, []).append(key)
        if len(groups[ident]) > 1:
            continue
        shape = found.shape if found else tuple(value.shape)
        if found is not None or isinstance(value, nn.Parameter):
            params += int(torch.Size(shape).numel())
            if shape == ():
                scalars.append(key)
    return {
        "tensors": sum(len(keys) for keys in groups.values()),
        "parameters": params,
        "tied": [keys for keys in groups.values() if len(keys) > 1],
        "scalars": scalars,
    }


def _snapshot(obj: Any) -> Any:
    """A copy of every tensor in ``obj`` (DTensor pieces keep their placement) so training can go on."""
    if isinstance(obj, DTensor):
        return DTensor.from_local(
            obj.to_local().clone(),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    return obj


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


def stage(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    state: Mapping[str, Any] | None = None,
    step: int,
    config: Mapping[str, Any] | None = None,
    data_fingerprint: str | None = None,
    parent_manifest_hash: str | None = None,
    kind: str = "sharded",
    tag: str | None = None,
    copy: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> StagedCheckpoint:
    """Capture what :func:`write_and_commit` will write.

    With ``copy=False`` the state dict references the live shards (no copy; write before
    training changes them). With ``copy=True`` tensors are copied, so training may continue
    while a background thread writes. Kind ``full`` gathers (a collective on the default group).
    """
    if kind not in SAVE_KINDS:
        raise ConfigurationError(
            f"checkpoints are saved with kind 'sharded' (default; reshardable) or 'full' (gathered on rank 0), "
            f"got {kind!r}; 'local' state dicts are for in-memory debugging only"
        )
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigurationError(f"step must be a non-negative int, got {step!r}")
    if data_fingerprint is not None and not isinstance(data_fingerprint, str):
        raise ConfigurationError(f"data_fingerprint must be a string or None, got {type(data_fingerprint).__name__}")
    rank = coord.group_rank(process_group)
    trainer = dict(state or {})
    per_rank = trainer.pop("per_rank", None)
    for key, value in hf_metadata(model).items():  # transformers / PEFT configs, for consolidate
        trainer.setdefault(key, value)
    sd: dict[str, Any] = {MODEL_KEY: model_state_dict(model, kind=kind)}  # type: ignore[arg-type]
    if optimizer is not None:
        sd[OPTIM_KEY] = optimizer_state_dict(model, optimizer, kind=kind)  # type: ignore[arg-type]
    # Note: only rank 0 contributes the shared trainer state and the config. DCP stores an item
    # that several ranks hold under the same key once, from whichever rank it picks; keeping it
    # on one rank makes "taken from rank 0" the rule instead of an accident.
    if rank == 0:
        sd[TRAINER_KEY] = encode_state(_cpu(trainer), "trainer state")
        if config is not None:
            sd[CONFIG_KEY] = _config_text(config)
    if per_rank is not None:
        sd[PER_RANK_KEY] = {str(rank): encode_state(_cpu(per_rank), f"per-rank trainer state of rank {rank}")}
    if copy and kind == "sharded":
        sd = _snapshot(sd)
    return StagedCheckpoint(
        final=Path(path),
        step=step,
        tag=tag,
        kind=kind,
        world_size=coord.group_size(process_group),
        state_dict=sd,
        units=describe_units(model),
        model_info=_model_info(model),
        contents={
            "model": True,
            "optimizer": optimizer is not None,
            "trainer_state": True,
            "per_rank_state": per_rank is not None,
            "config": config is not None,
        },
        config_sha256=config_hash(config) if config is not None else None,
        data_fingerprint=data_fingerprint,
        parent_manifest_hash=parent_manifest_hash,
    )


def _config_text(config: Mapping[str, Any]) -> str:
    import json

    config_hash(config)  # validates: plain JSON-able data only
    return json.dumps(config, sort_keys=True, ensure_ascii=False)


def _prepare(final: Path) -> Path:
    if final.exists() or final.is_symlink():
        raise CheckpointExistsError(
            f"checkpoint directory {final} already exists; shardline never overwrites a checkpoint. Save under a new "
            "step or path, or move the old one away first."
        )
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create the checkpoint parent directory {parent}: {e.strerror or e}. Choose a writable location."
        ) from None
    if not parent.is_dir():
        raise CheckpointError(f"cannot save into {parent}: it is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"cannot save a checkpoint into {parent}: no write permission for this user (uid {os.getuid()}). "
            "Choose a writable directory or fix its permissions."
        )
    tmp = tmp_dir_for(final)
    try:
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot create {tmp}: {e.strerror or e}. Choose a writable location.") from None
    return tmp


def preflight(path: str | os.PathLike, *, process_group: dist.ProcessGroup | None = None) -> Path:
    """Step 1 of the protocol (a collective): check the target on rank 0 and create the temp directory.

    Returns the temporary directory on every rank.

    Raises:
        CheckpointExistsError: the final directory exists (on every rank, nothing written).
        CheckpointError: the path is not writable or not visible from every rank.
    """
    fault.check_fault_spec()
    final = Path(path).absolute()
    verdict: dict[str, Any] = {}
    if coord.group_rank(process_group) == 0:
        try:
            verdict = {"tmp": str(_prepare(final))}
        except CheckpointError as e:
            verdict = {"error": str(e), "exists": isinstance(e, CheckpointExistsError)}
    verdict = coord.broadcast_object(verdict, process_group)
    if "error" in verdict:
        raise (CheckpointExistsError if verdict["exists"] else CheckpointError)(verdict["error"])
    tmp = Path(verdict["tmp"])
    seen = tmp.is_dir() and os.access(tmp, os.W_OK | os.X_OK)
    views = coord.all_gather_object(bool(seen), process_group)
    if not all(views):
        if coord.group_rank(process_group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        blind = [r for r, ok in enumerate(views) if not ok]
        raise CheckpointError(
            f"ranks {blind} cannot see or write {tmp}, which rank 0 created: the checkpoint directory must be on a "
            "file system shared by all ranks (or writable by every rank's user). Nothing was written."
        )
    return tmp


def write_and_commit(
    staged: StagedCheckpoint,
    tmp: Path,
    *,
    process_group: dist.ProcessGroup | None = None,
    after_commit: Callable[[CheckpointInfo], None] | None = None,
) -> CheckpointInfo:
    """Steps 2-6 of the protocol (a collective): write ``staged`` into ``tmp`` and commit it."""
    rank = coord.group_rank(process_group)
    final = staged.final.absolute()
    writer = HashingWriter(tmp, final_path=final)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(
                staged.state_dict,
                storage_writer=writer,
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
    except Exception as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint {final} failed; nothing was committed. Cause: {e}") from e
    outcome: dict[str, Any] = {}
    if rank == 0:
        committed = False
        try:
            digests = writer.file_digests or []
            manifest_digest, committed = _finalize(staged, tmp, final, digests)
            info = _info(staged, final, manifest_digest, digests)
            if after_commit is not None:
                after_commit(info)
            outcome = {"hash": manifest_digest, "files": info.files, "bytes": info.total_bytes}
        except Exception as e:
            if not committed:
                shutil.rmtree(tmp, ignore_errors=True)
            state = "committed, but publishing it failed" if committed else "not committed"
            outcome = {"error": f"checkpoint {final} {state}: {type(e).__name__}: {e}"}
    outcome = coord.broadcast_object(outcome, process_group)
    if "error" in outcome:
        raise CheckpointError(outcome["error"])
    return CheckpointInfo(
        path=final,
        step=staged.step,
        manifest_hash=outcome["hash"],
        tag=staged.tag,
        kind=staged.kind,
        world_size=staged.world_size,
        files=outcome["files"],
        total_bytes=outcome["bytes"],
        parent_manifest_hash=staged.parent_manifest_hash,
    )


def _info(staged: StagedCheckpoint, final: Path, digest: str, files: list[FileDigest]) -> CheckpointInfo:
    return CheckpointInfo(
        path=final,
        step=staged.step,
        manifest_hash=digest,
        tag=staged.tag,
        kind=staged.kind,
        world_size=staged.world_size,
        files=len(files),
        total_bytes=sum(f.bytes for f in files),
        parent_manifest_hash=staged.parent_manifest_hash,
    )


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _finalize(staged: StagedCheckpoint, tmp: Path, final: Path, digests: list[FileDigest]) -> tuple[str, bool]:
    """Rank 0: manifest, hash files, fsync, rename. Returns (manifest hash, committed)."""
    fault.maybe_fail("before_manifest", 0)
    listed = {d.path for d in digests}
    present = {p.name for p in tmp.iterdir()}
    if present != listed:
        raise CheckpointError(
            f"the temporary directory {tmp} holds {sorted(present - listed)} that no rank reported writing, or lacks "
            f"{sorted(listed - present)}; another process may be writing into it"
        )
    manifest = build_manifest(
        step=staged.step,
        tag=staged.tag,
        kind=staged.kind,
        world_size=staged.world_size,
        units=staged.units,
        model_info=staged.model_info,
        contents=staged.contents,
        config_sha256=staged.config_sha256,
        data_fingerprint=staged.data_fingerprint,
        parent_manifest_sha256=staged.parent_manifest_hash,
        files=digests,
    )
    data = canonical_json(manifest)
    digest = sha256_hex(data)
    _write_durable(tmp / MANIFEST, data)
    _write_durable(tmp / MANIFEST_HASH_FILE, render_manifest_hash_file(digest))
    _write_durable(tmp / SUMS_FILE, render_sums(digest, [d.to_json() for d in digests]))
    fsync_dir(tmp)
    fault.maybe_fail("after_manifest", 0)
    if final.exists() or final.is_symlink():
        raise CheckpointExistsError(f"{final} appeared while the checkpoint was being written; it was left untouched")
    os.rename(tmp, final)
    fsync_dir(final.parent)
    fault.maybe_fail("after_rename", 0)
    return digest, True


def save(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    state: Mapping[str, Any] | None = None,
    step: int,
    config: Mapping[str, Any] | None = None,
    data_fingerprint: str | None = None,
    parent_manifest_hash: str | None = None,
    kind: str = "sharded",
    tag: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> CheckpointInfo:
    """Save a checkpoint into the new directory ``path`` and commit it atomically (a collective).

    Args:
        path: The final checkpoint directory (e.g. ``run/checkpoints/step-100``); must not exist.
        model: The (sharded) model.
        optimizer: Its optimizer, saved keyed by parameter FQN.
        state: Trainer state: tensors, numbers, strings, bytes, None and nested dicts/lists/tuples.
            Entries are taken from rank 0, except ``state["per_rank"]``, which every rank saves
            under its own key (RNG states, data position...) and gets back from :func:`load`.
        step: Training step recorded in the manifest.
        config: The resolved training config (plain JSON data); stored and hashed canonically.
        data_fingerprint: A string identifying the training data, recorded in the manifest.
        parent_manifest_hash: Manifest hash of the checkpoint this training state descends from.
        kind: ``"sharded"`` (default: each rank writes its shards) or ``"full"`` (gathered, rank 0 writes).
        tag: Recorded in the manifest (e.g. ``"on_exception"``).
        process_group: Group the save runs over (default: the world).

    Returns:
        The committed checkpoint's :class:`CheckpointInfo`, identical on every rank.

    Raises:
        CheckpointExistsError: ``path`` exists (nothing is written).
        CheckpointError: unwritable path, or the write failed (nothing is committed).
    """
    tmp = preflight(path, process_group=process_group)
    staged = stage_agreed(
        tmp,
        process_group=process_group,
        path=path,
        model=model,
        optimizer=optimizer,
        state=state,
        step=step,
        config=config,
        data_fingerprint=data_fingerprint,
        parent_manifest_hash=parent_manifest_hash,
        kind=kind,
        tag=tag,
    )
    return write_and_commit(staged, tmp, process_group=process_group)


def stage_agreed(
    tmp: Path, *, process_group: dist.ProcessGroup | None, path: str | os.PathLike, **kwargs: Any
) -> StagedCheckpoint:
    """:func:`stage` on every rank, then agree that all succeeded (one small all-gather).

    A rank whose staging fails (e.g. trainer state that cannot be saved safely) would otherwise
    leave its peers waiting in the write; instead every rank raises and the temp directory goes.
    """
    staged, error = None, None
    try:
        staged = stage(path, process_group=process_group, **kwargs)
    except Exception as e:
        error = e
    failures = coord.all_gather_object(None if error is None else f"{type(error).__name__}: {error}", process_group)
    if any(f is not None for f in failures):
        if coord.group_rank(process_group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        rank, message = next((r, f) for r, f in enumerate(failures) if f is not None)
        raise CheckpointError(
            f"rank {rank} could not stage its part of checkpoint {path} ({message}); nothing was written"
        )
    assert staged is not None
    return staged
