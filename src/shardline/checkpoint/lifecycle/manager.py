"""``CheckpointManager``: a directory of checkpoints, its ``latest`` pointer and ledger, resume and async saves.

See :mod:`.directory` for the layout. Every method is a collective; each decision is taken on
rank 0 and reaches every rank through :func:`~.coord.rank0_decides`.

Note: what "newest" means. Checkpoints are ordered by the ledger -- the sequence number of
each one's commit row (:func:`.lineage.order`) -- never by a clock, so after an explicit resume
from an older checkpoint the branch trained since is what ``auto`` resumes, not an abandoned one
with a higher step, and a node whose clock is behind changes nothing. The commit point of a save
is the rename of its directory; ``latest`` and the ledger follow it. If a crash falls between
the rename and those updates, the checkpoint is still committed: the next manager on the
directory appends its ledger row (marked ``recovered``) and repoints ``latest``. Retention runs
after every rank has agreed on the commit, on rank 0 alone; its failure is a warning and never
touches the chain or the next save's parent.

Note: failing closed. Opening a manager checks the ledger's chain and compares it with the
committed checkpoints on disk (:mod:`.lineage`); a chain that does not verify is refused --
nothing is appended to it -- with the way to continue. ``load("auto")`` loads the newest
checkpoint that verifies: one that does not is moved aside (``step-N.damaged-<time>``, so a
later save of step N does not collide with it) and the next newest is tried. Only damage (a
hash mismatch, a missing or an extra file) moves a checkpoint; an error reading it (``EIO``,
``EACCES``, a decoder that refuses bytes matching their hashes) stops the load and moves nothing.

Note: a quarantine records before it moves. The ``quarantine`` row names where the checkpoint
will go; then the directory is renamed, its ``step-N.sig`` follows it, and ``latest`` is
repointed if it named it. A crash after the row leaves a move the next manager finishes
(:meth:`CheckpointManager._finish_quarantines`), so the ledger never meets a moved checkpoint
it does not account for.

Note: a directory in an object store (``s3://bucket/prefix``). The manager keeps its contract
through one seam -- :attr:`CheckpointManager.directory` is a :data:`~.objects.Location` -- and
differs where a bucket lacks what a disk has:

* the commit record is the manifest, uploaded last (:mod:`.save`); a prefix without one is
  never listed, loaded or resumed, and one a dead save left (its claim held by no live save) is
  cleared on open, so it cannot block a later save of its step (:mod:`.leftovers`);
* ``latest`` is derived, not stored: the newest regular checkpoint with a committed manifest,
  ordered by the ledger. A pointer object would be a second write after the commit that a
  crash can skip or a reader can see stale (no atomic rename, and a listing and a read of
  one object are not one snapshot); deriving it from the commit records cannot disagree with them;
* the ledger stays a local file (``ledger_path`` is required) and its rows name each
  checkpoint by URL;
* a damaged checkpoint is moved aside by copying, then deleting -- manifest first
  (:meth:`CheckpointManager._move_aside_in_store`); a move a crash interrupted is finished on
  open from its ``quarantine`` row's ``moved_to`` (:meth:`CheckpointManager._finish_store_quarantines`);
* retention (``keep_last_n``) deletes a checkpoint's manifest first, then the rest, after its
  tombstone row; a deletion a crash interrupted is finished by the next pass (:mod:`.retention`);
* async saves upload from the host staging buffers on the background thread, as on disk;
* a save claims its prefix first with a conditional PUT, so two runs on one prefix cannot both
  commit a step (:func:`.claim.claim`); the manager's ledger is still one run's, so two runs on one
  prefix should still each have their own ``checkpoint.dir`` -- the claim turns the mistake into
  one clear error instead of two interleaved checkpoints.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardline import _torch_compat
from shardline.checkpoint.coordination import coord
from shardline.checkpoint.coordination.parallelism import AUTO, resolve_files_per_rank
from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver, SavePhase
from shardline.checkpoint.integrity.manifest import DCP_METADATA, MANIFEST, read_manifest
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.capture import CapturedCheckpoint, SaveRequest
from shardline.checkpoint.lifecycle.host_buffers import HostBuffers, bind_writer_device
from shardline.checkpoint.lifecycle.load import load as load_checkpoint
from shardline.checkpoint.lifecycle.save import CheckpointInfo, capture_agreed, preflight, write_and_commit
from shardline.checkpoint.provenance.directory import (
    LATEST_FILE,
    aside_path,
    checkpoint_name,
    clear_latest,
    has_manifest,
    move_aside,
    read_latest,
    scan,
    step_of,
    write_latest,
)
from shardline.checkpoint.provenance.directory import CommittedCheckpoint as CommittedCheckpoint
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger, LedgerRow
from shardline.checkpoint.provenance.lineage import order, unrecorded
from shardline.checkpoint.provenance.retention import (
    RetentionPolicy,
    apply_retention,
    signature_path_for,
    tombstone_detail,
)
from shardline.checkpoint.provenance.statement import STATEMENT_FILE, read_statement
from shardline.checkpoint.storage.claims import CLAIM_SUFFIX, LEGACY_CLAIM, claim_path, describe_claim
from shardline.checkpoint.storage.fsutil import fsync_dir, is_tmp_lock_name, is_tmp_name, is_trash_name, tmp_in_use
from shardline.checkpoint.storage.object_leftovers import clear_store_leftovers
from shardline.checkpoint.storage.objects import Location, ObjectPath, as_location, check_access, is_url
from shardline.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    ConfigurationError,
    IntegrityError,
    LineageError,
    PublishError,
)

__all__ = [
    "ON_EXCEPTION",
    "RESUME_AUTO",
    "CheckpointManager",
    "CommittedCheckpoint",
    "is_auto_resume",
    "no_resume",
]

log = logging.getLogger(__name__)

ON_EXCEPTION = "on_exception"
RESUME_AUTO = "auto"
"""``resume`` value that picks the newest committed checkpoint that verifies (or none)."""


class CheckpointManager:
    """Saves ``directory/step-N`` checkpoints chained by parent manifest hash, with ``latest`` and a ledger.

    Every method that touches checkpoints is a collective: call it on every rank.

    Args:
        directory: Where checkpoints live (created if needed): a local directory, or an
            object-store URL ``s3://bucket/prefix`` (see the module note).
        ledger_path: The SQLite ledger (default ``directory/lineage.sqlite``; required, and local,
            for a URL).
        storage_options: Options of the fsspec file system of a URL (default: the AWS environment).
        async_save: Write checkpoints in a background thread. ``save`` returns once the state is
            copied (staged) into host buffers the manager reuses from save to save (pinned when
            the model is on CUDA; nothing extra on the model's device; :mod:`.host_buffers`) and
            freed by ``close``; the next ``save``, ``wait`` or ``close`` waits for the write and
            raises its error, if any. The background thread talks over its own gloo group so
            its collectives never interleave with training's.
        process_group: Group of the ranks that save (default: the world).
        observer: Told of each save's phases and writes (tests inject faults with one).
        keep_last_n: Keep only the newest N regular checkpoints (0, the default, keeps all). Older
            ones are deleted only after a newer one has committed, each recorded by a ``tombstone``
            row in the ledger first (:mod:`.retention`), so the chain still verifies without them.
        files_per_rank: Files each rank writes per checkpoint, each hashed by its own writer thread
            (0, the default: the cores each rank has on its node, at most 8; :mod:`.parallelism`).

    Raises:
        ConfigurationError: ``keep_last_n`` or ``files_per_rank`` is negative; a URL with no
            ``ledger_path``.
        StorageAccessError: a URL whose bucket does not exist, credentials are refused, or
            endpoint does not answer.
        LineageError: the ledger's chain does not verify, or committed checkpoints on disk are
            missing from it (on every rank; the message says how to continue).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        ledger_path: str | os.PathLike | None = None,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
        observer: SaveObserver | None = None,
        keep_last_n: int = 0,
        files_per_rank: int = AUTO,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.retention = RetentionPolicy(keep_last_n=keep_last_n)
        resolve_files_per_rank(files_per_rank)
        self.files_per_rank = files_per_rank
        self.storage_options = dict(storage_options or {})
        location = as_location(directory, storage_options=self.storage_options)
        self.directory: Location = location.absolute()
        if isinstance(self.directory, ObjectPath):
            if ledger_path is None or is_url(ledger_path):
                raise ConfigurationError(
                    f"checkpoints at {self.directory} need a local ledger_path (got {ledger_path!r}): the lineage "
                    "ledger is a SQLite file, e.g. RUN_DIR/lineage.sqlite"
                )
            check_access(self.directory)
        self.ledger = Ledger(Path(ledger_path).absolute() if ledger_path else Path(self.directory) / LEDGER_NAME)
        self.async_save = bool(async_save)
        self.observer = observer or NO_OBSERVER
        self.parent_manifest_hash: str | None = None
        self.resumed_from: Path | None = None
        self.moved_aside: list[Location] = []
        self._group = process_group
        self._io_group = process_group
        self._thread: threading.Thread | None = None
        self.staging_buffers: HostBuffers | None = HostBuffers() if self.async_save else None
        """The host buffers async saves stage into (None for synchronous saves)."""
        self._error: BaseException | None = None
        self._last: CheckpointInfo | None = None
        self._last_good: Path | None = None
        self._unrecorded: list[CheckpointInfo] = []  # committed saves whose ledger row may be missing
        self._rank = coord.group_rank(process_group)
        if self.async_save and coord.group_size(process_group) > 1:
            # Note: a dedicated group, created collectively here, so the background thread's
            # collectives cannot interleave with training's on the main group.
            timeout = _torch_compat.group_timeout(process_group)
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
            self._io_group = dist.new_group(ranks=ranks, backend="gloo", **kwargs)
        coord.rank0_decides(self._open, process_group)

    # ------------------------------------------------------------------ discovery
    @property
    def in_object_store(self) -> bool:
        """Whether the checkpoints live in an object store (``directory`` is a URL)."""
        return isinstance(self.directory, ObjectPath)

    def _location(self, text: str) -> Location:
        """A checkpoint named by rank 0 (as text) as a location of this manager's storage."""
        return as_location(text, storage_options=self.storage_options)

    def path_for(self, step: int, tag: str | None = None) -> Path:
        """The directory a save at ``step`` with ``tag`` goes to: ``step-N`` or ``step-N-TAG``."""
        return self.directory / checkpoint_name(step, tag)

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints in the directory, oldest first by the ledger (ones whose manifest is damaged are
        left out; see the module note)."""
        return order(scan(self.directory)[0], self._rows())

    def _rows(self) -> list[LedgerRow]:
        return self.ledger.rows() if self.ledger.path.is_file() else []

    def latest(self) -> Path | None:
        """The checkpoint the ``latest`` pointer names, or None (in an object store: the newest regular committed
        checkpoint by the ledger; see the module note)."""
        if self.in_object_store:
            regular = [c for c in self.committed() if c.tag is None]
            return regular[-1].path if regular else None
        return read_latest(self.directory)

    def _open(self) -> None:
        """Rank 0: drop leftovers of crashed saves; check the chain against the disk; finish an interrupted
        quarantine; record a checkpoint committed just before a crash; repoint ``latest``."""
        if not self.in_object_store:
            self._drop_leftovers()
        self._check_and_recover()

    def _drop_leftovers(self) -> None:
        """Rank 0, local directories: remove what crashed saves, retention and ``latest`` rewrites left."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for child in sorted(self.directory.iterdir()):
            if child.is_dir() and is_tmp_name(child.name):
                if tmp_in_use(child):  # another process is saving into it (see fsutil's note)
                    log.info("leaving %s: a save in another process holds it", child)
                    continue
                log.warning("removing %s, left by a checkpoint save that did not commit", child)
                shutil.rmtree(child, ignore_errors=True)
                child.with_name(child.name + ".lock").unlink(missing_ok=True)
            elif child.is_file() and is_tmp_lock_name(child.name) and not tmp_in_use(child.with_suffix("")):
                child.unlink(missing_ok=True)  # the lock of a save that crashed before its directory existed
            elif child.is_dir() and is_trash_name(child.name):
                log.info("removing %s, a checkpoint retention had recorded deleted and not finished removing", child)
                shutil.rmtree(child, ignore_errors=True)
            elif child.is_file() and child.name.startswith(f".{LATEST_FILE}.tmp-"):
                child.unlink(missing_ok=True)  # a `latest` rewrite a crash interrupted before its rename

    def _check_and_recover(self) -> None:
        """Rank 0: check the chain against the checkpoints; finish quarantines; record an interrupted publish."""
        problems: list[str] = []
        if self.ledger.path.is_file():
            problems += self.ledger.verify(check_checkpoints=False).problems
        elif self.ledger.head_path.exists():
            problems.append(f"the ledger is gone but its head record {self.ledger.head_path.name} is still there")
        if not problems:
            if self.in_object_store:
                self._finish_store_quarantines()
                clear_store_leftovers(self.directory, recorded=_recorded_committed(self._rows()), run=self._run())
            else:
                self._finish_quarantines()
        missing, recoverable = unrecorded(self.ledger, [self.directory])
        problems += [
            f"{c.path.name} (step {c.step}) is committed on disk but missing from the ledger"
            for c in missing
            if c is not recoverable
        ]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise LineageError(
                f"the lineage ledger {self.ledger.path} does not verify: {problems[0]}{more}; refusing to append to "
                f"a broken chain. Restore the ledger from a backup, or run `shardline lineage {self.ledger.path} "
                "--new-chain` to keep it aside and start a new chain whose first row records the break."
            )
        if recoverable is not None:
            self._ledger_row(recoverable, recovered=True)
        self._repoint_latest()
        committed = self.committed()
        self._last_good = committed[-1].path if committed else None

    def _repoint_latest(self) -> None:
        """Rank 0: ``latest`` names the newest regular checkpoint (by the ledger), or is removed when none is left.

        Nothing to do in an object store, where ``latest`` is derived (see the module note)."""
        if self.in_object_store:
            return
        regular = [c for c in self.committed() if c.tag is None]
        if regular:
            if self.latest() != regular[-1].path:
                write_latest(self.directory, regular[-1].path)
        elif (self.directory / LATEST_FILE).exists():
            clear_latest(self.directory)

    def _finish_quarantines(self) -> None:
        """Rank 0: complete moves that a ``quarantine`` row records but a crash interrupted (see the module note)."""
        base = self.ledger.path.parent
        rows = self._rows()
        for row in rows:
            if row.event != "quarantine":
                continue
            detail = tombstone_detail(row)
            if not detail.get("checkpoint") or not detail.get("moved_to"):
                continue
            source, target = base / str(detail["checkpoint"]), base / str(detail["moved_to"])
            if any(r.seq > row.seq and r.is_commit and r.checkpoint == detail["checkpoint"] for r in rows):
                continue  # the step was saved again after the quarantine: that directory is a new checkpoint
            if source.is_dir() and not target.exists():
                log.warning("finishing the move of %s to %s, which a crash interrupted", source.name, target.name)
                move_aside(source, target)
            signature, moved_signature = signature_path_for(source), signature_path_for(target)
            if not source.exists() and signature.is_file() and not moved_signature.exists():
                os.rename(signature, moved_signature)
                fsync_dir(signature.parent)

    def _explicit(self, resume: str | os.PathLike) -> Location:
        if is_url(resume):
            location = self._location(str(resume))
            if not has_manifest(location):
                raise CheckpointNotFoundError(
                    f"cannot resume from {location}: it is not a committed checkpoint (no manifest.json there)"
                )
            return location
        path = Path(resume)
        if not path.exists() and (self.directory / path).exists():
            path = self.directory / path
        path = path.absolute()
        if not path.is_dir():
            raise CheckpointNotFoundError(f"cannot resume from {resume}: no such checkpoint directory")
        if is_tmp_name(path.name):
            raise CheckpointNotFoundError(
                f"cannot resume from {path}: it is the temporary directory of a save that never committed"
            )
        if not has_manifest(path) and not (path / DCP_METADATA).is_file():
            raise CheckpointNotFoundError(
                f"cannot resume from {path}: it is not a committed checkpoint (no manifest.json and no {DCP_METADATA})"
            )
        return path

    def _candidates(self, resume: str | os.PathLike) -> dict[str, Any]:
        """Rank 0: what to try, newest first, with the manifest hash the ledger records for each (plain data)."""
        if not is_auto_resume(resume):
            paths = [self._explicit(resume)]
            damaged: list[list[str]] = []
        else:
            found, broken = scan(self.directory)
            paths = [c.path for c in reversed(order(found, self._rows()))]
            damaged = [[str(d.path), d.reason] for d in broken]
        return {
            "paths": [[str(p), self._recorded_hash(p)] for p in paths],
            "damaged": damaged,
        }

    def _recorded_hash(self, path: Location) -> str | None:
        """The manifest hash the newest commit row records for the checkpoint ``path`` (None if none)."""
        if not isinstance(path, ObjectPath):
            return self.ledger.recorded_hash(path)
        name = self._rel(path)
        found = [r.manifest_sha256 for r in self._rows() if r.is_commit and r.checkpoint == name]
        return found[-1] if found else None

    def resolve(self, resume: str | os.PathLike | None) -> Path | None:
        """Which checkpoint a resume would try first (a collective; rank 0 decides). Nothing is verified here.

        ``None``/``"none"``: none. ``"auto"``: the newest committed checkpoint, or None. A path
        (or a name inside ``directory``) must be a checkpoint directory.

        Raises:
            CheckpointNotFoundError: an explicit path that is not a checkpoint directory.
        """
        if no_resume(resume):
            return None
        self.wait()  # an async save in flight may commit the newest checkpoint
        plan = coord.rank0_decides(lambda: self._candidates(resume), self._group)
        return self._location(plan["paths"][0][0]) if plan["paths"] else None

    # ------------------------------------------------------------------ save / load
    def save(self, request: SaveRequest) -> CheckpointInfo | None:
        """Save ``directory/step-N`` (or ``step-N-TAG``), chained to the previous checkpoint (a collective).

        Waits for the previous async save first (raising its error). Synchronous: returns the
        :class:`CheckpointInfo`. Async: returns None once staged; :meth:`wait` returns the info.

        Raises:
            DiskFullError: the file system filled up; the message names the path, bytes needed
                vs free, and the last good checkpoint (which, like every earlier one, is intact).
        """
        self.wait()
        path = self.path_for(request.step, request.tag)
        run = self._run() if self.in_object_store and self._rank == 0 else None
        tmp = preflight(path, process_group=self._io_group, run=run)
        captured = capture_agreed(
            request,
            path=path,
            tmp=tmp,
            parent_manifest_hash=self.parent_manifest_hash,
            copy=self.async_save,
            buffers=self.staging_buffers,
            process_group=self._io_group,
        )
        if not self.async_save:
            return self._write(captured, tmp)
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(captured, tmp),
            name=f"shardline-checkpoint-step-{request.step}",
            daemon=True,
        )
        self._thread.start()
        return None

    def check_free(self, steps: Iterable[int]) -> None:
        """Refuse up front (a collective) if a regular save of any of ``steps`` would find its directory taken.

        One listing of the directory answers for every step (in a bucket: one LIST request, however
        many steps are planned); only a name found taken costs a second look, to say why.

        Raises:
            CheckpointExistsError: naming the first such directory, before any training is spent.
        """
        wanted = sorted(set(steps))

        def check() -> None:
            if isinstance(self.directory, ObjectPath):
                names = {child.name for child in self.directory.snapshot().iterdir()}
            else:
                names = set(os.listdir(self.directory)) if self.directory.is_dir() else set()
            for step in wanted:
                path = self.path_for(step)
                if path.name in names or path.name + CLAIM_SUFFIX in names:
                    raise CheckpointExistsError(self._taken(path, step, has_prefix=path.name in names))

        coord.rank0_decides(check, self._group)

    def _taken(self, path: Location, step: int, *, has_prefix: bool) -> str:
        """Why a save of ``step`` would find ``path`` taken, and what to do (for :meth:`check_free`)."""
        if has_prefix and has_manifest(path):
            return (
                f"{path} already exists, but this run will save step {step} there; checkpoints are never "
                "overwritten. Move it away, or resume from it (trainer.resume=auto resumes the newest)."
            )
        if isinstance(path, ObjectPath) and claim_path(path).exists():
            return (
                f"step {step} of this run would be saved to {path}, which another run is saving: "
                f"{describe_claim(claim_path(path))}. Give each run its own checkpoint.dir, or stop the other run; "
                "if it is gone, delete the claim (see docs/checkpoints.md, 'A save killed mid-upload')."
            )
        return (
            f"{path} exists but holds no committed checkpoint (no manifest.json), and this run will save step "
            f"{step} there; nothing can be resumed from it, and checkpoints are never written over it. Move it "
            "away (`shardline lineage` says whether the ledger records it)."
        )

    def _write(self, captured: CapturedCheckpoint, tmp: Path) -> CheckpointInfo:
        try:
            info = write_and_commit(
                captured,
                tmp,
                process_group=self._io_group,
                observer=self.observer,
                after_commit=self._publish,
                last_good=self._last_good,
                files_per_rank=self.files_per_rank,
            )
        except PublishError as e:  # committed: the next save chains to it even though recording it failed
            if isinstance(e.info, CheckpointInfo):
                self._committed(e.info)
                self._unrecorded.append(e.info)  # the next publish records it first, so the chain has no gap
            raise
        self._committed(info)
        if self._rank == 0:
            self._retain(info)
        return info

    def _committed(self, info: CheckpointInfo) -> None:
        self._last = info
        self._last_good = info.path
        self.parent_manifest_hash = info.manifest_hash

    def _write_in_background(self, captured: CapturedCheckpoint, tmp: Path) -> None:
        try:
            bind_writer_device(captured.source_device)  # a new thread starts on CUDA device 0
            self._write(captured, tmp)
        except BaseException as e:
            self._error = e

    def _publish(self, info: CheckpointInfo) -> None:
        """Rank 0, right after the commit and before every rank learns the outcome: repoint ``latest`` (regular
        saves) and append the ledger row."""
        while self._unrecorded:  # saves whose publish failed: each recorded before its child
            missed = self._unrecorded[0]
            if missed.manifest_hash not in self.ledger.manifest_hashes():
                self._ledger_row(missed, recovered=True)
            self._unrecorded.pop(0)
        if info.tag is None and not self.in_object_store:
            write_latest(self.directory, info.path)
        self.observer.on_phase(SavePhase.AFTER_LATEST, 0)
        self._ledger_row(info, recovered=False)

    def _retain(self, info: CheckpointInfo) -> None:
        """Rank 0, after every rank agreed on the commit: apply retention. A failure is a warning (the checkpoint
        is committed and recorded; the next save retries the deletions)."""
        try:
            apply_retention(
                directory=self.directory,
                ledger=self.ledger,
                policy=self.retention,
                just_committed=info.path,
                rel=self._rel,
            )
        except Exception as e:
            message = (
                f"retention (keep_last_n={self.retention.keep_last_n}) after {info.path.name} failed: "
                f"{type(e).__name__}: {e}. The checkpoint is committed and recorded and the chain is intact; "
                "older checkpoints were kept and the next save retries."
            )
            log.warning("%s", message)
            warnings.warn(message, CheckpointWarning, stacklevel=2)

    def _ledger_row(self, ckpt: CommittedCheckpoint | CheckpointInfo, *, recovered: bool) -> None:
        """Append the ledger row of a committed checkpoint (one found on disk, or one just saved).

        Its ``detail`` names the provenance statement and that file's SHA-256, so the ledger chains the statements.
        """
        statement = getattr(ckpt, "provenance_sha256", None)
        if statement is None:
            try:
                found = read_statement(ckpt.path)
            except IntegrityError:
                found = None
            statement = found[1] if found else None
        self.ledger.append(
            detail={"provenance": {"file": STATEMENT_FILE, "sha256": statement}} if statement else None,
            step=ckpt.step,
            tag=ckpt.tag,
            checkpoint=self._rel(ckpt.path),
            manifest_sha256=ckpt.manifest_hash,
            parent_manifest_sha256=ckpt.parent_manifest_hash,
            world_size=ckpt.world_size,
            recovered=recovered,
        )

    def _run(self) -> str:
        """This run as an object-store claim names it (rank 0): its ledger's path, and the ledger's first row once
        there is one (see :func:`.claim.judge`)."""
        rows = self._rows()
        return str(self.ledger.path) + (f"#{rows[0].row_sha256}" if rows else "")

    def _rel(self, path: Location) -> str:
        """How the ledger names a checkpoint: relative to the ledger's directory, or its URL."""
        if isinstance(path, ObjectPath):
            return str(path)
        return os.path.relpath(path, self.ledger.path.parent)

    def wait(self) -> CheckpointInfo | None:
        """Wait for an async save in flight; raise its error if it failed. Returns the last saved checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the background checkpoint save failed: {type(error).__name__}: {error}") from error
        return self._last

    def close(self) -> None:
        """Wait for any async save (raising its error); free the host staging buffers."""
        try:
            self.wait()
        finally:
            if self.staging_buffers is not None:
                self.staging_buffers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _record_quarantine(self, path: Location, target: Location, recorded: str | None, reason: str) -> None:
        """The ``quarantine`` row, appended before anything is moved (on disk or in a store)."""
        self.ledger.append(
            step=step_of(path.name) or 0,
            tag=None,
            checkpoint=self._rel(target),
            manifest_sha256=recorded or "",
            parent_manifest_sha256=None,
            world_size=0,
            event="quarantine",
            detail={"checkpoint": self._rel(path), "moved_to": self._rel(target), "reason": reason},
        )

    def _move_aside(self, path: Path, reason: str) -> str:
        """Rank 0: record, then move a checkpoint that failed verification aside (with its signature), and
        repoint ``latest``; returns the new path (see the module note).
        """
        if isinstance(path, ObjectPath):
            return self._move_aside_in_store(path, reason)
        target = aside_path(path)
        self._record_quarantine(path, target, self.ledger.recorded_hash(path), reason)
        crash_point("quarantine.recorded")
        moved = move_aside(path, target)
        crash_point("quarantine.moved")
        signature = signature_path_for(path)
        if signature.is_file():
            os.rename(signature, signature_path_for(moved))
            fsync_dir(path.parent)
            crash_point("quarantine.signature_moved")
        if self.latest() == path:
            self._repoint_latest()
            crash_point("quarantine.latest")
        if self._last_good == path:
            self._last_good = None
        log.warning(
            "checkpoint %s failed verification and was moved aside to %s (recorded in the ledger): %s",
            path.name,
            moved.name,
            reason,
        )
        return str(moved)

    def _move_aside_in_store(self, path: ObjectPath, reason: str) -> str:
        """Rank 0, object store: record, copy the checkpoint to ``step-N.damaged-<time>`` beside it, then delete it
        (its manifest first); returns the new URL.

        Note: an object store has no rename. The ``quarantine`` row comes first, as on disk, naming
        where the checkpoint goes (``moved_to``); then every object is copied (server side) to the
        aside prefix, whose name is not a checkpoint name; then the original's ``manifest.json`` --
        its commit record -- is deleted, so from that request on it is no longer listed or resumed,
        and the rest after it. A crash anywhere in between leaves a row whose source prefix still
        exists: the next manager on the directory finishes that same move -- copies what is missing
        at ``moved_to``, then deletes -- instead of failing the checkpoint again and moving it a
        second time under a new name (:meth:`_finish_store_quarantines`).
        """
        target = aside_path(path)
        self._record_quarantine(path, target, self._recorded_hash(path), reason)
        crash_point("quarantine.recorded")
        _finish_store_move(path, target)
        if self._last_good == path:
            self._last_good = None
        log.warning(
            "checkpoint %s failed verification and was moved aside to %s (recorded in the ledger): %s",
            path,
            target.name,
            reason,
        )
        return str(target)

    def _finish_store_quarantines(self) -> None:
        """Rank 0, object store: finish the moves that ``quarantine`` rows record but a crash interrupted (the source
        prefix is still there); one listing of the directory, and one of each such move's prefixes."""
        rows = self._rows()
        moves = [(row, tombstone_detail(row)) for row in rows if row.event == "quarantine"]
        if not moves:
            return
        present = {child.name for child in self.directory.snapshot().iterdir()}
        for row, detail in moves:
            source_text, target_text = str(detail.get("checkpoint") or ""), str(detail.get("moved_to") or "")
            if not is_url(source_text) or not is_url(target_text):
                continue
            source, target = self._location(source_text), self._location(target_text)
            if source.parent != self.directory or source.name not in present:
                continue
            if any(r.seq > row.seq and r.is_commit and r.checkpoint == source_text for r in rows):
                continue  # the step was saved again after the quarantine: that prefix is a new checkpoint
            if claim_path(source).name in present or (source / LEGACY_CLAIM).exists():
                continue  # a save holds the prefix (another run's, or a dead one's: cleared on open, see .leftovers)
            log.warning("finishing the move of %s to %s, which a crash interrupted", source, target.name)
            _finish_store_move(source, target)

    def load(
        self,
        resume: str | os.PathLike | None,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        verify: VerifyLevel | str = VerifyLevel.FULL,
    ) -> dict[str, Any] | None:
        """Load the checkpoint ``resume`` names (see :meth:`resolve`) and chain the next save to it.

        ``"auto"`` loads the newest checkpoint that verifies; each newer one that does not is
        moved aside and recorded in the ledger (see the module note). An explicit path that
        does not verify raises. A checkpoint the ledger records is verified against the
        manifest hash its row holds. ``verify`` other than ``full`` is recorded in the ledger.

        Returns:
            The trainer state (see :func:`shardline.checkpoint.load`), or None when there is
            nothing (that verifies) to resume from.

        Raises:
            CheckpointNotFoundError: an explicit path that is not a checkpoint.
            IntegrityError: an explicit checkpoint that does not verify.
            CheckpointMismatchError: the checkpoint does not fit the model (nothing is moved).
        """
        if no_resume(resume):
            return None
        self.wait()  # an async save in flight would otherwise overwrite the parent this load sets
        level = VerifyLevel.parse(verify)
        auto = is_auto_resume(resume)
        plan = coord.rank0_decides(lambda: self._candidates(resume), self._group)
        for path, reason in plan["damaged"]:
            moved = coord.rank0_decides(lambda p=path, r=reason: self._move_aside(self._location(p), r), self._group)
            self.moved_aside.append(self._location(moved))
        for path_text, expected in plan["paths"]:
            path = self._location(path_text)
            try:
                state = load_checkpoint(
                    path,
                    model=model,
                    optimizer=optimizer,
                    verify=level,
                    expected_manifest_hash=expected,
                    process_group=self._group,
                )
            except IntegrityError as e:
                if not auto:
                    raise
                moved = coord.rank0_decides(lambda p=path, r=str(e): self._move_aside(p, r), self._group)
                self.moved_aside.append(self._location(moved))
                continue
            self.resumed_from = path
            self.parent_manifest_hash = coord.rank0_decides(  # one answer for every rank, or one error
                lambda p=path: read_manifest(p)[1] if has_manifest(p) else None, self._group
            )
            if level.opt_in:
                coord.rank0_decides(lambda p=path: self._record_opt_in(p, level), self._group)
            return state
        return None

    def record_event(self, event: str, *, step: int, checkpoint: Path, detail: dict[str, Any]) -> None:
        """Append an ``event`` row about ``checkpoint`` (the one loaded) to the ledger; rank 0 writes it."""

        def append() -> None:
            self.ledger.append(
                step=step,
                tag=None,
                checkpoint=self._rel(checkpoint),
                manifest_sha256=self.parent_manifest_hash or "",
                parent_manifest_sha256=None,
                world_size=coord.group_size(self._group),
                event=event,
                detail=detail,
            )

        coord.rank0_decides(append, self._group)

    def _record_opt_in(self, path: Path, level: VerifyLevel) -> None:
        """Rank 0: a ``resume`` ledger row saying this load checked less than every byte."""
        self.ledger.append(
            step=int(read_manifest(path)[0]["step"]) if has_manifest(path) else 0,
            tag=None,
            checkpoint=self._rel(path),
            manifest_sha256=self.parent_manifest_hash or "",
            parent_manifest_sha256=None,
            world_size=coord.group_size(self._group),
            event="resume",
            detail={"checkpoint": self._rel(path), "verify": level.value},
        )


def _recorded_committed(rows: list[LedgerRow]) -> set[str]:
    """Checkpoints (as the ledger names them) whose newest row is their commit (not a tombstone or a move)."""
    newest: dict[str, bool] = {}
    for row in rows:
        if row.is_commit:
            newest[row.checkpoint] = True
        elif row.event == "tombstone":
            newest[row.checkpoint] = False
        elif row.event == "quarantine":
            newest[str(tombstone_detail(row).get("checkpoint") or "")] = False
    return {name for name, committed in newest.items() if committed}


def _finish_store_move(path: ObjectPath, target: ObjectPath) -> None:
    """Copy what ``target`` lacks of ``path``'s objects (server side), then delete ``path``: its manifest first."""
    fs = path.fs
    have = {str(k)[len(target.key) :].lstrip("/"): int(v.get("size") or 0) for k, v in _listing(target).items()}
    objects = _listing(path)
    for key, entry in sorted(objects.items()):
        name = key[len(path.key) :].lstrip("/")
        if have.get(name) != int(entry.get("size") or 0):
            fs.copy(key, f"{target.key}/{name}")
    crash_point("quarantine.store_copied")
    manifest = f"{path.key}/{MANIFEST}"
    if manifest in objects:
        (path / MANIFEST).unlink()
    crash_point("quarantine.store_manifest_deleted")
    path.remove_tree()  # the rest, and the prefix itself (a store with directories keeps an empty one)
    crash_point("quarantine.store_removed")


def _listing(prefix: ObjectPath) -> dict[str, dict[str, Any]]:
    """Every object under ``prefix`` (recursively): key -> its listing entry."""
    try:
        return {str(k): v for k, v in prefix.fs.find(prefix.key, detail=True).items() if v.get("type") != "directory"}
    except FileNotFoundError:
        return {}


def no_resume(resume: Any) -> bool:
    """Whether a ``resume`` argument asks for no checkpoint: None, or ``""``, ``"none"``, ``"false"`` (any case)."""
    return resume is None or str(resume).lower() in ("", "none", "false")


def is_auto_resume(resume: Any) -> bool:
    """Whether a ``resume`` argument is :data:`RESUME_AUTO` (the newest committed checkpoint that verifies)."""
    return resume is not None and str(resume) == RESUME_AUTO
