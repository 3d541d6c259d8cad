"""``save``: write a checkpoint with DCP, hash it while writing, and commit it atomically.

Note: the commit protocol (a collective over ``process_group``). Every go/no-go step is
:func:`~.coord.rank0_decides` or :func:`~.coord.all_succeed` (an all-reduce of a failure flag), so an
error reaches every rank as the same exception class with the same message.

1. **Preflight** (rank 0 decides): the final directory must not exist and its parent must be
   creatable and writable; rank 0 reserves it through its store (:meth:`.CheckpointStore.prepare`):
   on disk a hidden temporary directory beside it (``.step-100.tmp-<hex>``). Every rank then
   checks it can see and write that directory (all agree; in step 2's agreement when the caller
   passes ``check_writable=False``, as ``save`` and the manager do: one round trip fewer), so an
   unwritable or unshared path fails on every rank before any data is written. In an object store there is no temporary
   directory: rank 0 claims the final prefix with a conditional PUT (``storage/claims.py``), and
   the manifest, uploaded last and conditionally, commits; the claim is deleted after it. A save
   that dies before its manifest leaves a prefix the next manager clears on open
   (``storage/object_leftovers.py``).
2. **Capture** (all agree): each rank builds its state dict (:mod:`.capture`).
3. **Write**: ``torch.distributed.checkpoint.save`` with :class:`~.hashing_writer.HashingWriter`:
   each rank writes and fsyncs its ``.distcp`` files (one per writer thread), hashing each in the same pass; digests
   reach rank 0 inside the write results DCP gathers; rank 0 writes ``.metadata``.
4. **Manifest** (rank 0): ``manifest.json`` (canonical JSON, so its file hash is the manifest
   hash), ``manifest.sha256`` and ``SHA256SUMS``, each fsynced, then the directory is fsynced.
5. **Commit** (rank 0, :meth:`.CheckpointStore.commit`): ``rename(tmp, final)`` -- atomic on POSIX
   file systems -- and fsync the parent (in an object store: ``manifest.json`` uploaded last). This
   is the commit point: a directory with a final name is always complete.
6. **Publish** (rank 0, optional callback): the manager updates ``latest`` and the ledger.
7. Rank 0 tells every rank the outcome; every rank returns the same :class:`CheckpointInfo` or raises.
   A failure after the rename (the parent's fsync, or the publish) is :class:`~shardline.errors.PublishError`
   on every rank, carrying the ``CheckpointInfo``: the checkpoint is committed, and the caller
   chains the next save to it. The manager applies retention only after this step, on rank 0.

Each change to a file or directory here is a named crash point (:mod:`.crashpoints`).

A crash before step 5 leaves only a hidden temporary directory that nothing resumes from;
the final name is never overwritten (step 1 refuses an existing one, and step 5 re-checks).
A failed write (a full disk, a dead peer) removes the temporary directory and touches nothing
else, so the previous checkpoints stay as they were.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.coordination.parallelism import AUTO, resolve_files_per_rank
from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver, SavePhase
from shardline.checkpoint.format.packed_layout import DEFAULT_SEGMENT_BYTES, CheckpointLayout
from shardline.checkpoint.integrity.copy_check import check_written
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.hashing_writer import HashingWriter
from shardline.checkpoint.integrity.manifest import (
    MANIFEST,
    MANIFEST_HASH_FILE,
    SUMS_FILE,
    render_manifest_hash_file,
)
from shardline.checkpoint.integrity.plan_validation import ShardlineSavePlanner
from shardline.checkpoint.lifecycle.capture import CapturedCheckpoint, SaveKind, SaveRequest, capture
from shardline.checkpoint.lifecycle.commit_records import build_records
from shardline.checkpoint.lifecycle.host_buffers import HostBuffers
from shardline.checkpoint.lifecycle.summary import human_bytes
from shardline.checkpoint.provenance.statement import STATEMENT_FILE
from shardline.checkpoint.storage.protocol import CommitRecord, Location
from shardline.checkpoint.storage.stores import describe, locate, store_for
from shardline.errors import CheckpointError, CheckpointExistsError, DiskFullError, PublishError, error_chain

__all__ = [
    "CheckpointInfo",
    "capture_agreed",
    "commit",
    "commit_written",
    "committed_info",
    "disk_full_cause",
    "preflight",
    "save",
    "write_and_commit",
]

_FULL = (errno.ENOSPC, errno.EDQUOT)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as every rank learns it from rank 0 at the end of a save."""

    path: Location
    step: int
    manifest_hash: str
    tag: str | None
    kind: str
    world_size: int
    files: int
    total_bytes: int
    parent_manifest_hash: str | None
    provenance_sha256: str | None = None
    """SHA-256 of the checkpoint's provenance statement (``provenance.intoto.json``)."""


def preflight(
    path: str | os.PathLike[str] | Location,
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    run: Callable[[], str | None] | str | None = None,
    check_writable: bool = True,
) -> Location:
    """Step 1 of the protocol (a collective): rank 0 reserves the target through its store, every rank checks it
    can write there.

    Returns the in-progress location on every rank (on disk the temporary directory; in an object
    store the final prefix, claimed). ``run``: the run an object-store claim names (a callable is
    asked on rank 0 only, when a claim is made). ``check_writable=False`` leaves the check to
    :func:`capture_agreed`, which runs it in its own agreement (one collective fewer per save).

    Raises:
        CheckpointExistsError: the final directory exists (on every rank, nothing written).
        CheckpointError: the path is not writable or not visible from every rank.
    """
    return _preflight(
        path, process_group=process_group, storage_options=storage_options, run=run, check_writable=check_writable
    )[0]


def _preflight(
    path: str | os.PathLike[str] | Location,
    *,
    process_group: dist.ProcessGroup | None,
    storage_options: Mapping[str, Any] | None,
    run: Callable[[], str | None] | str | None,
    check_writable: bool = True,
) -> tuple[Location, Location | None]:
    """:func:`preflight`, and the newest committed checkpoint beside the target when the store found it."""
    final = locate(path, storage_options=storage_options).absolute()
    store = store_for(final)
    asked = run if callable(run) or run is None else (lambda: run)
    name, found = coord.rank0_decides(lambda: store.prepare(final, run=asked), process_group)
    in_progress = final.with_name(name)
    last_good = final.with_name(found.rsplit("/", 1)[-1]) if found else None
    if not check_writable:
        return in_progress, last_good
    rank = coord.group_rank(process_group)
    try:
        coord.all_succeed(
            lambda: store.check_writable(in_progress, prepared_here=rank == 0),
            process_group,
            what="write the checkpoint directory",
        )
    except Exception:  # a rank that cannot write there: the save stops on every rank
        if rank == 0:
            store.discard(in_progress)
        raise
    return in_progress, last_good


def capture_agreed(
    request: SaveRequest,
    *,
    path: str | os.PathLike[str] | Location,
    tmp: Location,
    parent_manifest_hash: str | None = None,
    copy: bool = False,
    buffers: HostBuffers | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> CapturedCheckpoint:
    """Step 2 (a collective): :func:`~.capture.capture` on every rank, then agree that all succeeded.

    ``copy`` and ``buffers`` are passed to :func:`~.capture.capture` (an async save's host copy).

    A rank whose capture fails (e.g. trainer state that cannot be saved safely) would otherwise
    leave its peers waiting in the write; instead every rank raises the same error and the temp
    directory goes. The returned ``total_bytes`` counts every rank's share.

    Every rank first checks that it can see and write ``tmp`` (as :func:`preflight` does), in the
    same agreement: a save whose preflight skipped that check (``check_writable=False``) still
    fails on every rank, before any data is written, when the directory is not shared.
    """

    captured: CapturedCheckpoint | None = None
    rank = coord.group_rank(process_group)

    def capture_here() -> int:
        nonlocal captured
        store_for(tmp).check_writable(tmp, prepared_here=rank == 0)
        captured = capture(
            request,
            path=path,
            parent_manifest_hash=parent_manifest_hash,
            copy=copy,
            buffers=buffers,
            process_group=process_group,
        )
        return captured.total_bytes

    try:
        total = coord.all_succeed_total(capture_here, process_group, what=f"stage its part of checkpoint {path}")
    except Exception:
        if rank == 0:
            store_for(tmp).discard(tmp)
        raise
    assert captured is not None  # all_succeed_total returned, so this rank's step succeeded
    return replace(captured, total_bytes=total)


def disk_full_cause(error: BaseException) -> BaseException | None:
    """The "no space left" (or quota) error behind ``error``, if there is one."""
    for e in error_chain(error):
        if isinstance(e, OSError) and e.errno in _FULL:
            return e
        if isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e):
            return e
    return None


def _first_line(error: BaseException) -> str:
    """The innermost error's type and first message line (DCP's own text is a multi-line traceback dump)."""
    for e in error_chain(error):
        if not isinstance(e, CheckpointException):
            text = str(e).strip().splitlines()
            return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return type(error).__name__


def _failure_message(
    final: Location, captured: CapturedCheckpoint, error: BaseException, last_good: Location | None
) -> str:
    """Rank 0, after a failed write: one line naming the cause (for a full disk: bytes needed vs free)."""
    previous = f"the last good checkpoint is {last_good}" if last_good else "no earlier checkpoint is known here"
    store = store_for(final)
    refused = store.refusal(final, error, previous=previous)
    if refused is not None:
        return refused
    full = disk_full_cause(error)
    if full is None:
        return f"writing checkpoint {describe(final)} failed ({_first_line(error)}); nothing was committed; {previous}"
    free_bytes = store.free_bytes(final.parent)
    free = human_bytes(free_bytes) if free_bytes is not None else "unknown"
    where = getattr(full, "filename", None) or final
    return (
        f"disk full: writing checkpoint {final} needs about {human_bytes(captured.total_bytes)}, {free} free on "
        f"{final.parent} ({type(full).__name__}: {getattr(full, 'strerror', None) or full} at {where}); nothing "
        f"was committed and earlier checkpoints are intact; {previous}. Free space or save elsewhere, then resume."
    )


def write_and_commit(
    captured: CapturedCheckpoint,
    tmp: Location,
    *,
    process_group: dist.ProcessGroup | None = None,
    observer: SaveObserver = NO_OBSERVER,
    after_commit: Callable[[CheckpointInfo], None] | None = None,
    last_good: Location | None = None,
    files_per_rank: int = AUTO,
) -> CheckpointInfo:
    """Steps 3-7 of the protocol (a collective): write ``captured`` into ``tmp`` (the in-progress location
    :func:`preflight` returned) and commit it.

    Each rank writes ``files_per_rank`` files (0: automatic, :mod:`.parallelism`).

    Raises:
        DiskFullError: a rank ran out of space (the message names the path, bytes needed vs
            free, and ``last_good``); nothing was committed.
        PublishError: the checkpoint committed, but making the rename durable or
            ``after_commit`` failed; its ``info`` is the committed checkpoint.
        CheckpointExistsError: another run took the checkpoint while this save wrote it (nothing of
            the other run was deleted).
        CheckpointError: any other failure, named in the first line of the message.
    """
    final = captured.final.absolute()
    store = store_for(final)
    check = None
    if captured.staged_digests is not None:
        check = functools.partial(check_written, staged=captured.staged_digests)
    # Rank 0's data files flush in the background while .metadata and the commit records are written; the store's
    # commit flushes .metadata with the records and waits for all of them before the commit point.
    writer = HashingWriter(
        tmp,
        final_path=final,
        observer=observer,
        check_written=check,
        files_per_rank=files_per_rank,
        sync_later=True,
    )
    failure: BaseException | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(
                captured.state_dict,
                storage_writer=writer,
                planner=ShardlineSavePlanner(
                    layout=captured.layout, segment_bytes=captured.segment_bytes, files_per_rank=files_per_rank
                ),
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
    except (Exception, CheckpointException) as e:  # DCP raises CheckpointException, a BaseException
        failure = e
    if failure is not None:

        def clean_up() -> None:
            store.discard(tmp)
            error = DiskFullError if disk_full_cause(failure) is not None else CheckpointError
            raise error(_failure_message(final, captured, failure, last_good))

        coord.rank0_decides(clean_up, process_group)

    def finalize() -> dict[str, Any]:
        digests, synced = writer.file_digests or [], writer.wait_synced
        return commit_written(
            captured,
            tmp,
            digests,
            observer=observer,
            after_commit=after_commit,
            last_good=last_good,
            wait_synced=synced,
        )

    try:
        outcome = coord.rank0_decides(finalize, process_group)
    finally:
        store.end_save(tmp)  # renamed, committed or removed by now
    return committed_info(captured, outcome)


def commit_written(
    captured: CapturedCheckpoint,
    tmp: Location,
    digests: list[FileDigest],
    *,
    observer: SaveObserver = NO_OBSERVER,
    after_commit: Callable[[CheckpointInfo], None] | None = None,
    last_good: Location | None = None,
    wait_synced: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Rank 0, steps 4-6 once every rank's files are in ``tmp`` (``digests``: as the hashing writer gathered them).

    Returns the outcome every rank learns (plain data, :func:`committed_info`). A failure before the commit removes
    ``tmp`` and raises; one after it is the outcome's ``problem``. :func:`write_and_commit` and the DCP-native
    writer (:mod:`.dcp_writer`) both commit through here.
    """
    final = captured.final.absolute()
    store = store_for(final)
    done: dict[str, Any] = {}  # _finalize fills it once the checkpoint is committed
    try:
        manifest_digest, files, statement_digest = _finalize(
            captured, tmp, final, digests, observer, done, wait_synced=wait_synced
        )
    except Exception as e:
        if not done:
            store.discard(tmp)  # what this save wrote and holds: never another run's files (see the store)
            if isinstance(e, CheckpointExistsError):
                raise  # the target was taken meanwhile: the store's message names it
            message = _failure_message(final, captured, e, last_good)
            raise (DiskFullError if disk_full_cause(e) is not None else CheckpointError)(message) from e
        # committed, but making it durable failed (the parent's fsync): the name may not survive a power loss
        outcome = _outcome(done["hash"], done["files"], done["provenance"])
        return {**outcome, "problem": f"making the commit durable failed ({_first_line(e)})"}
    outcome = _outcome(manifest_digest, files, statement_digest)
    if after_commit is not None:
        try:
            after_commit(committed_info(captured, outcome))
        except Exception as e:
            outcome["problem"] = f"recording it failed ({_first_line(e)})"
    return outcome


def committed_info(captured: CapturedCheckpoint, outcome: Mapping[str, Any]) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of :func:`commit_written`'s outcome; :class:`PublishError` (carrying it) when
    the checkpoint committed but making it durable or recording it failed."""
    final = captured.final.absolute()
    info = CheckpointInfo(
        path=final,
        step=captured.step,
        manifest_hash=outcome["hash"],
        tag=captured.tag,
        kind=captured.kind,
        world_size=captured.world_size,
        files=outcome["files"],
        total_bytes=outcome["bytes"],
        parent_manifest_hash=captured.parent_manifest_hash,
        provenance_sha256=outcome["provenance"],
    )
    if outcome.get("problem") is not None:
        raise PublishError(
            f"checkpoint {final} committed (manifest {info.manifest_hash[:12]}), but {outcome['problem']}; it is "
            "complete and the next save chains to it. Fix the cause; the next CheckpointManager on "
            f"{final.parent} records it in the ledger (marked recovered) if its row is missing.",
            info=info,
        )
    return info


def _outcome(digest: str, files: list[FileDigest], statement_digest: str) -> dict[str, Any]:
    """What rank 0 tells every rank about a committed checkpoint (plain data); ``problem``: what failed after it."""
    total = sum(f.bytes for f in files)
    return {"hash": digest, "files": len(files), "bytes": total, "provenance": statement_digest, "problem": None}


def _finalize(
    captured: CapturedCheckpoint,
    tmp: Location,
    final: Location,
    digests: list[FileDigest],
    observer: SaveObserver,
    done: dict[str, Any],
    *,
    wait_synced: Callable[[], None] = lambda: None,
) -> tuple[str, list[FileDigest], str]:
    """Rank 0: provenance statement, manifest and hash files, then the commit through the store.

    ``wait_synced`` waits for the flushes of rank 0's data files, which run in the background
    from the moment each was closed (``HashingWriter(sync_later=True)``); the other ranks'
    files were flushed before their part of the write returned.

    Returns (manifest hash, every listed file, the statement's sha256). Once the checkpoint is
    committed, ``done`` holds the same under ``hash``, ``files``, ``provenance``, so a caller that
    sees an error after it knows the checkpoint is committed.
    """
    crash_point("save.shards_written")
    observer.on_phase(SavePhase.BEFORE_MANIFEST, 0)
    _check_listing(tmp, digests)
    made = build_records(captured, digests)
    digest, files, statement_digest = made.manifest_sha256, made.files, made.statement_sha256
    records = [
        CommitRecord(STATEMENT_FILE, made.statement, written="save.statement_written"),
        CommitRecord(MANIFEST, made.manifest, written="save.manifest_written"),  # the commit record: last in a store
        CommitRecord(MANIFEST_HASH_FILE, render_manifest_hash_file(digest), written="save.hash_file_written"),
        CommitRecord(SUMS_FILE, made.sums),
    ]
    store_for(final).commit(
        tmp,
        final,
        records=records,
        # Note: nothing else to flush. .metadata went through a hashing stream like the data files, whose close
        # started its fsync in the background (sync_later); wait_synced waits for it before the commit point, so
        # flushing it again with the records would be a second fsync of the same file.
        flush=[],
        observer=observer,
        wait_synced=wait_synced,
        on_commit=lambda: done.update(hash=digest, files=files, provenance=statement_digest),
    )
    return digest, files, statement_digest


def _check_listing(tmp: Location, digests: list[FileDigest]) -> None:
    """Every file in ``tmp`` is one a rank reported writing, and every reported one is there."""
    listed = {d.path for d in digests}
    folders = {"/".join(p.split("/")[:n]) for p in listed if "/" in p for n in range(1, p.count("/") + 1)}
    present = _present(store_for(tmp).snapshot(tmp), folders)
    if present != listed:
        raise CheckpointError(
            f"the temporary directory {tmp} holds {sorted(present - listed)} that no rank reported writing, or lacks "
            f"{sorted(listed - present)}; another process may be writing into it"
        )


def _present(folder: Location, folders: set[str], prefix: str = "") -> set[str]:
    """The files in ``folder`` by relative path, looking into the ``folders`` (relative paths) the reported files
    are in (a bucket save's ``shards/GGGG/``, see ``key_prefixes.py``); anything else is named as it is."""
    present: set[str] = set()
    for child in folder.iterdir():
        name = prefix + child.name
        if name in folders and child.is_dir():
            present |= _present(child, folders, name + "/")
        else:
            present.add(name)
    return present


def commit(
    path: str | os.PathLike[str] | Location,
    request: SaveRequest,
    *,
    parent_manifest_hash: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    observer: SaveObserver = NO_OBSERVER,
    files_per_rank: int = AUTO,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Save ``request`` into the new directory ``path`` and commit it atomically (a collective; see :func:`save`)."""
    resolve_files_per_rank(files_per_rank)  # a bad count fails before anything is created
    # The capture records the final location (with its storage options); the preflight may also find the newest
    # committed checkpoint beside it, which a failure message names.
    final = locate(path, storage_options=storage_options).absolute()
    # The writability check runs inside the capture's agreement (one collective, not two).
    tmp, last_good = _preflight(
        final, process_group=process_group, storage_options=storage_options, run=None, check_writable=False
    )
    captured = capture_agreed(
        request, path=final, tmp=tmp, parent_manifest_hash=parent_manifest_hash, process_group=process_group
    )
    return write_and_commit(
        captured,
        tmp,
        process_group=process_group,
        observer=observer,
        files_per_rank=files_per_rank,
        last_good=last_good,
    )


def save(
    path: str | os.PathLike[str] | Location,
    *,
    model: nn.Module,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
    state: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    data_fingerprint: str | None = None,
    parent_manifest_hash: str | None = None,
    kind: SaveKind = "sharded",
    tag: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    observer: SaveObserver | None = None,
    files_per_rank: int = AUTO,
    storage_options: Mapping[str, Any] | None = None,
    run_tags: Mapping[str, str] | None = None,
    layout: CheckpointLayout | str = CheckpointLayout.PER_TENSOR,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> CheckpointInfo:
    """Save a checkpoint into the new directory ``path`` and commit it atomically (a collective).

    The keyword arguments other than ``path``, ``parent_manifest_hash``, ``process_group``,
    ``observer`` and ``files_per_rank`` make a :class:`~.capture.SaveRequest` (see it for their meaning).

    Args:
        path: The final checkpoint directory (e.g. ``run/checkpoints/step-100``), or an object-store URL
            (``s3://bucket/prefix/step-100``: written in place, committed by its manifest, uploaded last);
            must not exist.
        parent_manifest_hash: Manifest hash of the checkpoint this training state descends from.
        process_group: Group the save runs over (default: the world).
        observer: Told of each phase and write (tests inject faults with one; default: none).
        files_per_rank: Files each rank writes, each hashed by its own writer thread and verified on
            its own reader thread (0, the default: the cores each rank has on its node, at most 8).
        storage_options: Options of the fsspec file system of a URL ``path`` (``endpoint_url``, ``key``,
            ``secret``...); default: the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...).
        layout: ``"per_tensor"`` (default) or ``"packed"`` (each rank's row shards in a few segments; see
            :class:`~.capture.SaveRequest`).
        segment_bytes: The packed layout's segment size (default 256 MiB).

    Returns:
        The committed checkpoint's :class:`CheckpointInfo`, identical on every rank.

    Raises:
        CheckpointExistsError: ``path`` exists (nothing is written).
        DiskFullError: the file system filled up (nothing is committed; the message says how much was needed).
        CheckpointError: unwritable path, or the write failed (nothing is committed).
        StorageAccessError: a URL whose bucket does not exist, whose credentials are refused, or whose endpoint
            does not answer (nothing is written).
        ConfigurationError: ``files_per_rank`` is not a count, or the layout options are bad (nothing is written).
    """
    request = SaveRequest(
        model=model,
        step=step,
        optimizer=optimizer,
        state=state,
        config=config,
        data_fingerprint=data_fingerprint,
        kind=kind,
        tag=tag,
        run_tags=run_tags,
        layout=layout,
        segment_bytes=segment_bytes,
    )
    return commit(
        path,
        request,
        parent_manifest_hash=parent_manifest_hash,
        process_group=process_group,
        observer=observer or NO_OBSERVER,
        files_per_rank=files_per_rank,
        storage_options=storage_options,
    )
