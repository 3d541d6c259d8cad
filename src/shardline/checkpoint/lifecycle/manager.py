"""``CheckpointManager``: a directory of checkpoints, its ``latest`` pointer and ledger, resume and async saves.

See :mod:`.directory` for the layout. Every method is a collective; each decision is taken on
rank 0 and reaches every rank through :func:`~.coord.rank0_decides`.

Note: the manager composes, it does not contain. It wires:

* the **store** of its directory (``storage/``: :func:`~.stores.store_for`), which answers every
  question that differs between a local directory and an object-store prefix -- how a save is
  prepared and committed, where ``latest`` comes from, how a checkpoint is moved aside or
  removed, what a crash leaves. The manager never asks which backend it is on;
* **recovery on open** (:mod:`.recovery`): leftovers cleared, the chain checked against the
  checkpoints, interrupted quarantines finished, a checkpoint committed just before a crash
  recorded (``recovered``), ``latest`` repointed;
* **resume selection** (:mod:`.resume`): which checkpoints a ``resume`` tries, newest first by
  the ledger, and which are damaged (:class:`~.resume.ResumeCandidates`);
* **quarantine** (:mod:`.quarantine`): a checkpoint that fails verification on ``auto`` is moved
  aside, recorded first;
* the **async writer** (:mod:`.async_writer`): one background write at a time on its own group;
* **retention** (:mod:`~shardline.checkpoint.provenance.retention`): ``keep_last_n`` and best-k
  (``keep_best_k`` by a recorded metric, :mod:`~shardline.checkpoint.provenance.best`) behind
  tombstone rows, after every rank agreed on a commit, on rank 0 alone (a failure is a warning);
* the **ledger rows** (:mod:`.rows`).

Note: what "newest" means. Checkpoints are ordered by the ledger -- the sequence number of
each one's commit row (:func:`.lineage.order`) -- never by a clock. The commit point of a save
is its store's commit (the rename of its directory; in a bucket, its manifest); ``latest`` and
the ledger follow it. If a crash falls between the commit and those updates, the checkpoint is
still committed: the next manager on the directory appends its ledger row (``recovered``) and
repoints ``latest``.

Note: failing closed. ``load("auto")`` loads the newest checkpoint that verifies: one that does
not is moved aside and the next newest is tried. Only damage (a hash mismatch, a missing or an
extra file) moves a checkpoint; an error reading it (``EIO``, ``EACCES``, a decoder that refuses
bytes matching their hashes) stops the load and moves nothing.

Note: a directory in an object store (``s3://bucket/prefix``) keeps the same contract; the
ledger stays a local file (``ledger_path`` is required) and its rows name each checkpoint by
URL. Two runs on one prefix should each have their own ``checkpoint.dir``: a save claims its
prefix first, so the mistake is one clear error instead of two interleaved checkpoints
(docs/checkpoint-protocol.md, "The commit protocol in an object store").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.coordination.parallelism import AUTO, resolve_files_per_rank
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver, SavePhase
from shardline.checkpoint.format.packed_layout import DEFAULT_SEGMENT_BYTES, CheckpointLayout
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.async_writer import AsyncWriter
from shardline.checkpoint.lifecycle.capture import CapturedCheckpoint, SaveRequest, check_layout_options
from shardline.checkpoint.lifecycle.host_buffers import HostBuffers
from shardline.checkpoint.lifecycle.load import load_verified
from shardline.checkpoint.lifecycle.quarantine import move_aside
from shardline.checkpoint.lifecycle.recovery import recover, run_name
from shardline.checkpoint.lifecycle.resume import (
    RESUME_AUTO,
    ResumeCandidates,
    find_candidates,
    is_auto_resume,
    no_resume,
)
from shardline.checkpoint.lifecycle.save import CheckpointInfo, capture_agreed, preflight, write_and_commit
from shardline.checkpoint.provenance.best import BestPolicy, metrics_detail
from shardline.checkpoint.provenance.directory import CommittedCheckpoint as CommittedCheckpoint
from shardline.checkpoint.provenance.directory import checkpoint_name, has_manifest, step_recorded
from shardline.checkpoint.provenance.directory_rows import read_directory
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger, LedgerRow
from shardline.checkpoint.provenance.records import record_commit, record_restart, record_resume
from shardline.checkpoint.provenance.retention import RetentionPolicy, apply_retention
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import local_path, locate, store_for
from shardline.errors import (
    CheckpointExistsError,
    CheckpointWarning,
    ConfigurationError,
    IntegrityError,
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
            its collectives never interleave with training's (:mod:`.async_writer`).
        process_group: Group of the ranks that save (default: the world).
        observer: Told of each save's phases and writes (tests inject faults with one).
        keep_last_n: Keep only the newest N regular checkpoints (0, the default, keeps all). Older
            ones are deleted only after a newer one has committed, each recorded by a ``tombstone``
            row in the ledger first (:mod:`.retention`), so the chain still verifies without them.
        keep_best_k: Also keep the K checkpoints with the best ``monitor`` value (0, the default: none kept as
            best). Each save's ``SaveRequest.metrics`` are recorded in its commit row; a checkpoint without a
            value for ``monitor`` is never kept as best. With ``keep_last_n`` the union is kept, and always the
            newest regular checkpoint (:mod:`~shardline.checkpoint.provenance.best`).
        monitor: The metric that ranks checkpoints for ``keep_best_k`` (e.g. ``"val_loss"``).
        mode: ``"min"`` (lower is better, the default) or ``"max"``.
        files_per_rank: Files each rank writes per checkpoint, each hashed by its own writer thread
            (0, the default: the cores each rank has on its node, at most 8; :mod:`.parallelism`).
        tags: Run tags (``{"ticket": "ABC-1", "owner": "..."}``), recorded in every checkpoint's
            manifest and provenance statement (``run_tags``); a request's own ``run_tags`` win per key.
        layout: How sharded saves store their tensors: ``"per_tensor"`` (default) or ``"packed"`` (see
            :class:`~.capture.SaveRequest`); a request's own ``layout`` wins, and a ``full`` save stays per tensor.
        segment_bytes: The packed layout's segment size (default 256 MiB).

    Raises:
        ConfigurationError: ``keep_last_n``, ``keep_best_k`` or ``files_per_rank`` is negative; ``mode``
            is not min/max; ``keep_best_k`` without ``monitor``; a URL with no ``ledger_path``; a tag
            that is not a short ``KEY: VALUE`` string pair (:mod:`..provenance.run_tags`).
        StorageAccessError: a URL whose bucket does not exist, credentials are refused, or
            endpoint does not answer.
        LineageError: the ledger's chain does not verify, or committed checkpoints on disk are
            missing from it (on every rank; the message says how to continue).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Location,
        *,
        ledger_path: str | os.PathLike[str] | None = None,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
        observer: SaveObserver | None = None,
        keep_last_n: int = 0,
        files_per_rank: int = AUTO,
        storage_options: dict[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        keep_best_k: int = 0,
        monitor: str | None = None,
        mode: str = "min",
        layout: CheckpointLayout | str = CheckpointLayout.PER_TENSOR,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        self.layout = CheckpointLayout.parse(layout)
        check_layout_options(self.layout, segment_bytes, kind="sharded")
        self.segment_bytes = segment_bytes
        self.tags = check_run_tags(tags)
        """The run tags every save records (checked, sorted by key)."""
        best = BestPolicy(keep_best_k=keep_best_k, monitor=monitor, mode=mode)
        self.retention = RetentionPolicy(keep_last_n=keep_last_n, best=best)
        resolve_files_per_rank(files_per_rank)
        self.files_per_rank = files_per_rank
        self.storage_options = dict(storage_options or {})
        self.directory: Location = locate(directory, storage_options=self.storage_options).absolute()
        self.store = store_for(self.directory)
        """The store of :attr:`directory`: every operation that differs between backends goes through it."""
        # The ledger is a SQLite file of this machine: beside local checkpoints by default; named for a bucket's.
        local = local_path(ledger_path) if ledger_path is not None else local_path(self.directory)
        if local is None:
            raise ConfigurationError(
                f"checkpoints at {self.directory} need a local ledger_path (got {ledger_path!r}): the lineage "
                "ledger is a SQLite file, e.g. RUN_DIR/lineage.sqlite"
            )
        self.store.check_access(self.directory)
        ledger_file = local.absolute() if ledger_path is not None else local / LEDGER_NAME
        self.ledger = Ledger(ledger_file, storage_options=self.storage_options)
        self.async_save = bool(async_save)
        self.observer = observer or NO_OBSERVER
        self.parent_manifest_hash: str | None = None
        self.resumed_from: Location | None = None
        self.moved_aside: list[Location] = []
        self._group = process_group
        self.staging_buffers: HostBuffers | None = HostBuffers() if self.async_save else None
        """The host buffers async saves stage into (None for synchronous saves)."""
        self._last: CheckpointInfo | None = None
        self._last_good: Location | None = None
        self._unrecorded: list[CheckpointInfo] = []  # committed saves whose ledger row may be missing
        self._metrics: dict[Location, dict[str, str]] = {}  # each save's metrics, as its commit row records them
        self._rank = coord.group_rank(process_group)
        self._writer = AsyncWriter(process_group, enabled=self.async_save)  # a collective when async
        self._io_group = self._writer.group
        coord.rank0_decides(self._open, process_group)

    # ------------------------------------------------------------------ discovery
    def path_for(self, step: int, tag: str | None = None) -> Location:
        """Where a save at ``step`` with ``tag`` goes: ``step-N`` or ``step-N-TAG`` in :attr:`directory`."""
        return self.directory / checkpoint_name(step, tag)

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints in the directory, oldest first by the ledger (ones whose manifest is damaged are
        left out; see the module note)."""
        return read_directory(self.directory, ledger=self.ledger, rel=self.ledger.name_of).committed  # their rows only

    def _rows(self) -> list[LedgerRow]:
        return self.ledger.rows() if self.ledger.path.is_file() else []

    def _newest_regular(self) -> Location | None:
        regular = [c for c in self.committed() if c.tag is None]
        return regular[-1].path if regular else None

    def latest(self) -> Location | None:
        """The checkpoint ``latest`` names, or None: the ``latest`` file on disk; in an object store, which keeps
        no pointer, the newest regular committed checkpoint by the ledger (:meth:`.CheckpointStore.read_latest`)."""
        return self.store.read_latest(self.directory, newest=self._newest_regular)

    def _open(self) -> None:
        """Rank 0: recover from crashes on open (:mod:`.recovery`)."""
        self._last_good = recover(self.directory, ledger=self.ledger, committed=self.committed)

    def _run(self) -> str:
        """This run as an object-store claim names it (rank 0; :func:`.recovery.run_name`)."""
        return run_name(self.ledger, self._rows())

    def _candidates(self, resume: str | os.PathLike[str]) -> ResumeCandidates:
        """Rank 0's plan for ``resume``, as every rank gets it."""
        plan = coord.rank0_decides(
            lambda: find_candidates(
                resume, directory=self.directory, ledger=self.ledger, storage_options=self.storage_options
            ).to_json(),
            self._group,
        )
        return ResumeCandidates.from_json(plan)

    def resolve(self, resume: str | os.PathLike[str] | None) -> Location | None:
        """Which checkpoint a resume would try first (a collective; rank 0 decides). Nothing is verified here.

        ``None``/``"none"``: none. ``"auto"``: the newest committed checkpoint, or None. A path
        (or a name inside ``directory``) must be a checkpoint directory.

        Raises:
            CheckpointNotFoundError: an explicit path that is not a checkpoint directory.
        """
        if no_resume(resume):
            return None
        self.wait()  # an async save in flight may commit the newest checkpoint
        assert resume is not None  # no_resume(None) is True
        plan = self._candidates(resume)
        return self._location(plan.committed[0].location) if plan.committed else None

    def _location(self, text: str) -> Location:
        """A checkpoint named by rank 0 (as text) as a location of this manager's storage."""
        return locate(text, storage_options=self.storage_options)

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
        if self.tags:
            request = dataclasses.replace(request, run_tags={**self.tags, **(request.run_tags or {})})
        if request.layout is None and request.kind == "sharded":
            request = dataclasses.replace(
                request, layout=self.layout, segment_bytes=request.segment_bytes or self.segment_bytes
            )
        path = self.path_for(request.step, request.tag)
        self._metrics[path] = metrics_detail(request.metrics or {})
        # capture_agreed checks that every rank can write tmp, in its own agreement (one collective fewer).
        tmp = preflight(path, process_group=self._io_group, run=self._run, check_writable=False)
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
        self._writer.start(
            lambda: self._write(captured, tmp),
            name=f"shardline-checkpoint-step-{request.step}",
            device=captured.source_device,
        )
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
            names = self.store.names(self.directory)
            for step in wanted:
                path = self.path_for(step)
                if self.store.is_taken(names, path.name):
                    raise CheckpointExistsError(self._taken(path, step, has_prefix=path.name in names))

        coord.rank0_decides(check, self._group)

    def _taken(self, path: Location, step: int, *, has_prefix: bool) -> str:
        """Why a save of ``step`` would find ``path`` taken, and what to do (for :meth:`check_free`)."""
        if has_prefix and has_manifest(path):
            return (
                f"{path} already exists, but this run will save step {step} there; checkpoints are never "
                "overwritten. Move it away, or resume from it (trainer.resume=auto resumes the newest)."
            )
        holder = self.store.holder(path)
        if holder is not None:
            return (
                f"step {step} of this run would be saved to {path}, which another run is saving: "
                f"{holder}. Give each run its own checkpoint.dir, or stop the other run; "
                "if it is gone, delete the claim (see docs/checkpoints.md, 'A save killed mid-upload')."
            )
        return (
            f"{path} exists but holds no committed checkpoint (no manifest.json), and this run will save step "
            f"{step} there; nothing can be resumed from it, and checkpoints are never written over it. Move it "
            "away (`shardline lineage` says whether the ledger records it)."
        )

    def _write(self, captured: CapturedCheckpoint, tmp: Location) -> CheckpointInfo:
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

    def _publish(self, info: CheckpointInfo) -> None:
        """Rank 0, right after the commit and before every rank learns the outcome: repoint ``latest`` (regular
        saves) and append the ledger row."""
        while self._unrecorded:  # saves whose publish failed: each recorded before its child
            missed = self._unrecorded[0]
            if missed.manifest_hash not in self.ledger.manifest_hashes():
                record_commit(self.ledger, missed, recovered=True, **self._measured(missed))
            self._unrecorded.pop(0)
        if info.tag is None:
            self.store.write_latest(self.directory, info.path)
        self.observer.on_phase(SavePhase.AFTER_LATEST, 0)
        record_commit(self.ledger, info, recovered=False, **self._measured(info))

    def _measured(self, info: CheckpointInfo) -> dict[str, Any]:
        """What ``info``'s commit row records besides the commit: the save's metrics and the best-k policy."""
        metrics = self._metrics.pop(info.path, {})
        best = self.retention.best
        if not best.active:
            return {"metrics": metrics}
        if best.monitor not in metrics and info.tag is None:
            log.warning(
                "%s has no %s value (SaveRequest.metrics): it is never kept as best (%s)",
                info.path.name,
                best.monitor,
                best.describe(),
            )
        return {"metrics": metrics, "keep_best": best.to_json()}

    def _retain(self, info: CheckpointInfo) -> None:
        """Rank 0, after every rank agreed on the commit: apply retention. A failure is a warning (the checkpoint
        is committed and recorded; the next save retries the deletions)."""
        try:
            apply_retention(
                directory=self.directory,
                ledger=self.ledger,
                policy=self.retention,
                just_committed=info.path,
                rel=self.ledger.name_of,
            )
        except Exception as e:
            message = (
                f"retention ({self.retention.describe()}) after {info.path.name} failed: "
                f"{type(e).__name__}: {e}. The checkpoint is committed and recorded and the chain is intact; "
                "older checkpoints were kept and the next save retries."
            )
            log.warning("%s", message)
            warnings.warn(message, CheckpointWarning, stacklevel=2)

    def wait(self) -> CheckpointInfo | None:
        """Wait for an async save in flight; raise its error if it failed. Returns the last saved checkpoint."""
        self._writer.wait()
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

    def _move_aside(self, path: Location, reason: str) -> str:
        """Rank 0: record, then move a checkpoint that failed verification aside (:mod:`.quarantine`); returns where
        it went, as text."""
        moved = move_aside(
            path, ledger=self.ledger, directory=self.directory, reason=reason, newest=self._newest_regular
        )
        if self._last_good == path:
            self._last_good = None
        return str(moved)

    def load(
        self,
        resume: str | os.PathLike[str] | None,
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
        assert resume is not None  # no_resume(None) is True
        plan = self._candidates(resume)
        for damaged in plan.damaged:
            moved = coord.rank0_decides(
                functools.partial(lambda d: self._move_aside(self._location(d.location), d.reason), damaged),
                self._group,
            )
            self.moved_aside.append(self._location(moved))
        for candidate in plan.committed:
            path = self._location(candidate.location)
            try:
                state, manifest_hash = load_verified(
                    path,
                    model=model,
                    optimizer=optimizer,
                    verify=level,
                    expected_manifest_hash=candidate.manifest_hash,
                    process_group=self._group,
                )
            except IntegrityError as e:
                if not auto:
                    raise
                moved = coord.rank0_decides(functools.partial(self._move_aside, path, str(e)), self._group)
                self.moved_aside.append(self._location(moved))
                continue
            self.resumed_from = path
            self.parent_manifest_hash = manifest_hash  # the hash the load anchored, the same on every rank
            if level.opt_in:
                coord.rank0_decides(functools.partial(self._record_opt_in, path, level), self._group)
            return state
        return None

    def record_restart(
        self,
        *,
        step: int,
        checkpoint: Location,
        world_size_before: int | None,
        world_size_after: int,
        cause: str,
        elastic_restart: int = 0,
    ) -> None:
        """Append the ``restart`` row about ``checkpoint`` (the one loaded) to the ledger; rank 0 writes it."""

        def append() -> None:  # nothing but the outcome crosses ranks
            record_restart(
                self.ledger,
                checkpoint=checkpoint,
                step=step,
                manifest_hash=self.parent_manifest_hash,
                world_size=coord.group_size(self._group),
                world_size_before=world_size_before,
                world_size_after=world_size_after,
                cause=cause,
                elastic_restart=elastic_restart,
            )

        coord.rank0_decides(append, self._group)

    def _record_opt_in(self, path: Location, level: VerifyLevel) -> None:
        """Rank 0: a ``resume`` ledger row saying this load checked less than every byte."""
        record_resume(
            self.ledger,
            checkpoint=path,
            step=step_recorded(path),
            manifest_hash=self.parent_manifest_hash,
            world_size=coord.group_size(self._group),
            verify=level.value,
        )
