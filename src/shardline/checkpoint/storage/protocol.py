"""The storage seam: every operation the checkpoint protocols need from where checkpoints live.

Note: what the seam is. Save, load, the manager, retention, quarantine and signing never ask
which backend holds a checkpoint; they call a :class:`CheckpointStore` -- found with
:func:`~.stores.store_for` -- and it answers for its backend. There are two:

* :class:`~.local.LocalStore`, a local (or network) file system: a save writes into a hidden
  temporary directory it holds a lock on, and commits by fsync and one atomic ``rename``; the
  ``latest`` pointer is a file; moves are renames; a removal renames to a hidden name first.
* :class:`~.object_store.ObjectStore`, an object store through fsspec (``s3://bucket/prefix``):
  no rename and no fsync, so a save claims its prefix with a conditional PUT, writes in place,
  and commits by uploading ``manifest.json`` last, conditionally; ``latest`` is derived from the
  commit records; a move is copy-then-delete and a removal deletes the commit record first.

A location (:data:`Location`) is a ``pathlib.Path`` or an :class:`~.objects.ObjectPath`: both
answer the read-side path operations (join a name, list, stat, open, read) the same way, so the
code that reads and checks a checkpoint is written once. What differs -- how a save is prepared,
written and committed, how a checkpoint is moved aside or removed, what an interrupted save
leaves and how it is cleared, where ``latest`` comes from, how a location reads in a message --
is an operation of the store. Outside ``checkpoint/storage/`` no module names a backend.

What each operation guarantees is in its docstring; the crash point each step passes (the
commit protocol's, :mod:`~shardline.checkpoint.faults.crashpoints`) is named by the
implementation, and ``tests/checkpoint/test_crash_points.py`` and
``test_object_store_lifecycle.py`` crash each one at every point it reaches.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shardline.checkpoint.faults.observer import SaveObserver
from shardline.checkpoint.storage.calibration import SaveTuning
from shardline.checkpoint.storage.objects import ObjectPath

__all__ = [
    "CHECKPOINT_NAME",
    "COMMIT_RECORD",
    "CheckpointStore",
    "Cleared",
    "CommitRecord",
    "Location",
    "SaveFiles",
    "is_checkpoint_name",
]

Location = Path | ObjectPath
"""Where a checkpoint (or a directory of them) lives: a local path, or a location in an object store.

Both answer ``/ name``, ``name``, ``parent``, ``with_name``, ``exists``, ``is_dir``, ``is_file``,
``iterdir``, ``stat``, ``open("rb")``, ``read_bytes``; what else a protocol needs, the store does."""

COMMIT_RECORD = "manifest.json"
"""The file whose presence makes a checkpoint committed: written last by every save, removed first by every
removal (on disk the rename commits, and the manifest is what a committed directory holds)."""

CHECKPOINT_NAME = re.compile(r"^step-(?P<step>\d+)(?:-(?P<tag>[a-z0-9_]+))?$")
"""A checkpoint's name in its directory: ``step-N`` (a regular save) or ``step-N-TAG``."""


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint directory name (``step-N`` or ``step-N-TAG``)."""
    return CHECKPOINT_NAME.match(name) is not None


@dataclass(frozen=True)
class CommitRecord:
    """One file of a save's commit (the statement, ``manifest.json``, its hash file, ``SHA256SUMS``).

    ``written`` names the crash point a store that writes records one at a time passes after this one.
    """

    name: str
    data: bytes
    written: str | None = None


@dataclass(frozen=True)
class Cleared:
    """A save target cleared on open: where, how many files and unfinished uploads went, and why it was stale."""

    prefix: str
    objects: int
    uploads: int
    reason: str


class SaveFiles(ABC):
    """The files of a save in progress as DCP's writer addresses them (the ``FileSystem`` the hashing writer wraps).

    Paths are what DCP passes: ``root`` joined with names by :meth:`join`.
    """

    root: str | os.PathLike[str]
    """What DCP's writer is given as its directory."""
    fsync: bool
    """Whether a file is made durable by an fsync of its descriptor (local files); an upload is durable once the
    store acknowledged it, and has no descriptor."""
    uploads: bool
    """Whether writes wait on a network (each file is then hashed as it is written, see ``digest_queue.py``)."""

    def tuning(self, *, writers: int, cores: int) -> SaveTuning:
        """How a rank writing ``writers`` files on ``cores`` cores hashes and flushes them (:mod:`.calibration`).

        Here, for uploads: each file is hashed as it is written (the upload waits on the network), nothing to flush.
        """
        return SaveTuning(
            hash_during_writes=True,
            writeback_every=None,
            hash_threads=max(1, min(writers, cores)),
            source="upload",
            reason="an upload waits on the network: hash as the bytes are written",
        )

    @abstractmethod
    def data_prefix(self, rank: int) -> str:
        """The file-name prefix (relative to ``root``) of ``rank``'s data files, to which DCP appends ``N.distcp``:
        ``__R_`` on disk (flat); ``shards/GGGG/__R_`` in an object store, spread over key prefixes
        (:mod:`.key_prefixes`). Readers follow the relative paths the checkpoint records, never this."""

    @abstractmethod
    def open_write(self, path: str) -> BinaryIO:
        """A new file at ``path``, opened for writing (an upload completes when it is closed)."""

    @abstractmethod
    def written(self, path: str) -> None:
        """``path`` was closed: it is complete (and, for an upload, stored)."""

    @abstractmethod
    def join(self, path: str | os.PathLike[str], name: str) -> str | os.PathLike[str]:
        """``name`` inside ``path``."""

    @abstractmethod
    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Make ``path`` a directory (nothing where directories are only prefixes)."""

    @abstractmethod
    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists."""

    @abstractmethod
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Move the file ``path`` to ``new_path`` (DCP's ``.metadata.tmp`` to ``.metadata``)."""

    @abstractmethod
    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete the file ``path``."""


class CheckpointStore(ABC):
    """The operations the checkpoint protocols need from where checkpoints live (see the module note).

    A store is stateless: one instance per backend answers for every location of that backend.
    Operations that change checkpoints run on rank 0 (the caller coordinates the ranks).
    """

    place: str
    """Where its checkpoints are, for messages: ``on disk`` or ``in the object store``."""
    absent: str
    """What a location that does not exist is, for messages: ``no such directory``, ``no object under that
    prefix``."""

    # ------------------------------------------------------------------ naming, access, messages
    @abstractmethod
    def describe(self, location: Location) -> str:
        """``location`` for a message: the path; a URL with the endpoint it is reached through."""

    @abstractmethod
    def describe_directory(self, directory: Location) -> str:
        """A directory of checkpoints for a message: its path; ``the bucket prefix URL/ (endpoint ...)``."""

    @abstractmethod
    def short_name(self, location: Location) -> str:
        """How a message names a checkpoint: its directory name on disk, its whole URL in an object store."""

    @abstractmethod
    def ledger_name(self, location: Location, *, relative_to: Path) -> str:
        """How the ledger at ``relative_to`` names ``location``: a path relative to it, or the URL."""

    @abstractmethod
    def check_access(self, location: Location) -> None:
        """Check that ``location`` can be reached (a bucket that exists and may be listed); nothing on disk.

        Raises:
            StorageAccessError: naming the endpoint, the bucket and how to fix it.
        """

    @abstractmethod
    def copy_command(self, location: Location | str, into: str, *, recursive: bool, note: bool = False) -> str | None:
        """The standard tool's command that copies ``location`` to the local ``into`` (None: it is local already);
        ``note`` adds a shell comment naming the endpoint."""

    # ------------------------------------------------------------------ reading
    @abstractmethod
    def snapshot(self, location: Location) -> Location:
        """``location`` with its children's presence and sizes taken at once (one listing in a store; on disk
        the path itself), for checks that ask about every file of a checkpoint."""

    @abstractmethod
    def open_read(self, file: Location) -> BinaryIO:
        """``file`` opened for reading, unbuffered on disk, with ranged read-ahead in a store."""

    @abstractmethod
    def local_file(self, location: Location) -> Path | None:
        """``location`` as a path of this machine's file system (that DCP's own reader and ``mmap`` can use), or
        None."""

    @abstractmethod
    def local_copy(self, location: Location) -> AbstractContextManager[Path]:
        """A local directory (or file) holding what ``location`` holds, for tools that read local files only
        (signing): the path itself on disk, a temporary copy of every object under the prefix in a store.

        Raises:
            SignatureError: nothing is stored under ``location``.
        """

    @abstractmethod
    def put(self, location: Location, data: bytes) -> None:
        """Replace the small file ``location`` with ``data`` whole (atomically: a reader sees the old or the new)."""

    # ------------------------------------------------------------------ a directory of checkpoints
    @abstractmethod
    def names(self, directory: Location) -> set[str]:
        """The names in ``directory`` (one listing; empty when it does not exist)."""

    @abstractmethod
    def is_taken(self, listing: set[str], name: str) -> bool:
        """Whether a listing of a directory (:meth:`names`) shows the checkpoint ``name`` taken: there already, or
        reserved by a save in progress (a store's claim beside it; on disk a save reserves a hidden temporary
        name, never the final one)."""

    @abstractmethod
    def may_hold_checkpoints(self, directory: Location) -> bool:
        """Whether listing ``directory`` may find checkpoints: a local directory that exists; a bucket prefix
        always (listing an empty one costs one request, and :meth:`check_access` names an unreachable bucket)."""

    @abstractmethod
    def still_there(self, checkpoint: Location) -> bool:
        """Whether anything of ``checkpoint`` is still stored: its directory on disk; its commit record in a
        store (one that lists prefixes as directories may keep listing an emptied one)."""

    @abstractmethod
    def find_checkpoint(self, location: Location, *, given: str, directory: Location) -> Location:
        """The checkpoint an explicit resume names (``given``, as the user wrote it): ``location`` itself, or on
        disk a name inside the manager's ``directory``.

        Raises:
            CheckpointNotFoundError: it is not a checkpoint (no directory, a save's temporary directory, no
                commit record -- on disk, a plain DCP directory counts, loadable at ``verify="none"``).
        """

    @abstractmethod
    def open_directory(self, directory: Location) -> None:
        """Rank 0, when a manager opens ``directory``: create it, and remove what crashed saves, removals and
        ``latest`` rewrites left that nothing needs the ledger to judge (on disk: hidden temporary directories
        no live save holds). Nothing in a store, whose leftovers the ledger judges (:meth:`clear_leftovers`)."""

    @abstractmethod
    def clear_leftovers(self, directory: Location, *, committed: set[str], run: str | None) -> list[Cleared]:
        """Rank 0, after the ledger verified: clear the save targets of saves that died before their commit and
        that no live save holds (in a store: prefixes without a manifest, their uploads and claims).

        ``committed`` names (as the ledger does) the checkpoints the ledger records as committed, never cleared;
        ``run`` is this run as a claim names it. Nothing on disk (:meth:`open_directory` did it).
        """

    @abstractmethod
    def read_latest(self, directory: Location, *, newest: Callable[[], Location | None]) -> Location | None:
        """The checkpoint the ``latest`` record of ``directory`` names (None if none). A store that keeps no
        record (an object store: a pointer object could disagree with the commit records) answers ``newest()``,
        the newest regular committed checkpoint by the ledger."""

    @abstractmethod
    def write_latest(self, directory: Location, checkpoint: Location) -> None:
        """Rank 0, after a regular save committed: point ``latest`` at it (atomically; nothing where it is derived).

        Crash points: ``latest.tmp_written``, ``latest.replaced``.
        """

    @abstractmethod
    def repoint_latest(
        self, directory: Location, *, newest: Callable[[], Location | None], only_from: Location | None = None
    ) -> bool:
        """Rank 0: make ``latest`` name ``newest()`` (or remove it when that is None); with ``only_from``, only if
        it named that checkpoint (one just moved aside). Returns whether it changed (never, where it is derived)."""

    # ------------------------------------------------------------------ a save
    @abstractmethod
    def prepare(self, final: Location, *, run: Callable[[], str | None] | None = None) -> tuple[str, str | None]:
        """Rank 0, first step of a save: refuse a taken ``final`` and reserve it; returns the name (beside
        ``final``) of the in-progress location the ranks write into, and the newest committed checkpoint beside
        ``final`` when the preparation found it (for failure messages), else None.

        On disk: a new hidden ``.step-N.tmp-<hex>`` directory, locked by this process until the save ends
        (crash point ``save.tmp_created``). In a store: ``final`` itself, claimed by a conditional PUT naming
        ``run()`` (crash point ``save.store_claimed``).

        Raises:
            CheckpointExistsError: ``final`` exists, or another save holds it (nothing written).
            CheckpointError: it cannot be written (the message says why and what to do).
        """

    @abstractmethod
    def check_writable(self, in_progress: Location, *, prepared_here: bool) -> None:
        """Every rank, after :meth:`prepare`: this rank can write ``in_progress``.

        Raises:
            CheckpointError: it cannot (unshared or unwritable directory; an unreachable bucket).
        """

    @abstractmethod
    def save_files(self, in_progress: Location) -> SaveFiles:
        """How DCP's writer (through the hashing writer) writes the files of a save into ``in_progress``.

        Crash points (a store): ``save.store_uploaded`` per object, ``save.store_metadata_copied``.
        """

    @abstractmethod
    def commit(
        self,
        in_progress: Location,
        final: Location,
        *,
        records: Sequence[CommitRecord],
        flush: Sequence[str],
        observer: SaveObserver,
        wait_synced: Callable[[], None],
        on_commit: Callable[[], None],
    ) -> None:
        """Rank 0: write the commit ``records`` (the one named :data:`COMMIT_RECORD` last) and commit: from the
        moment ``on_commit`` is called, ``final`` is a complete checkpoint that survives a crash.

        ``flush`` names files of ``in_progress`` written without an fsync (DCP's ``.metadata``), ``wait_synced``
        waits for the data files' background flushes. On disk: every record fsynced together with them, then
        ``rename(in_progress, final)`` and the parent fsynced (crash points ``save.<record>_written``,
        ``save.sums_written``, ``save.renamed``, ``save.committed``). In a store: the other records uploaded,
        then the manifest by a conditional PUT while this save still holds its claim, then the claim released
        (``save.sums_written``, ``save.committed``, ``save.store_claim_released``). Observer phases
        ``AFTER_MANIFEST`` and ``AFTER_RENAME`` are told.

        Raises:
            CheckpointExistsError: ``final`` was taken meanwhile (another run); this save was not committed,
                and nothing of the other run is deleted by :meth:`discard` afterwards.
        """

    @abstractmethod
    def commit_in_place(self, location: Location, *, records: Sequence[CommitRecord]) -> None:
        """Rank 0: commit the files already at ``location`` (a checkpoint written by another tool, adopted) by
        adding the commit ``records`` beside them, the one named :data:`COMMIT_RECORD` last; nothing already
        there is moved, rewritten or removed.

        On disk: each record created (never over an existing file) and fsynced with the directory, then the
        manifest written under a hidden name, fsynced and linked to its name (atomic: a reader sees all of it
        or none), and the directory fsynced. In a store: the other records uploaded, then the manifest by a
        conditional PUT.

        Raises:
            CheckpointExistsError: a record's name is taken (another adoption or save committed it meanwhile).
        """

    @abstractmethod
    def discard(self, in_progress: Location) -> None:
        """Rank 0, after a save failed before its commit: remove what it wrote into ``in_progress`` and give up what it
        held (the temporary directory and its lock; the objects and the claim -- never another run's)."""

    @abstractmethod
    def end_save(self, in_progress: Location) -> None:
        """Every rank, when a save ends however it ends: drop what this process holds for it (the lock)."""

    @abstractmethod
    def refusal(self, final: Location, error: BaseException, *, previous: str) -> str | None:
        """The one line for a save that ``error`` shows the storage refused (a store's permission or quota), or
        None. ``previous`` says which checkpoint is the last good one."""

    @abstractmethod
    def free_bytes(self, directory: Location) -> int | None:
        """Free space where ``directory`` is (None where that is not known), for a full-disk message."""

    @abstractmethod
    def holder(self, final: Location) -> str | None:
        """Who holds ``final`` for a save in progress, for a message (a store's claim), or None."""

    # ------------------------------------------------------------------ moving and removing checkpoints
    @abstractmethod
    def move_aside(self, path: Location, target: Location) -> None:
        """Rank 0: move the checkpoint ``path`` to ``target`` beside it (``step-N.damaged-<time>``), after its
        ``quarantine`` row. On disk a rename and the parent fsynced (``quarantine.moved``); in a store a
        server-side copy, then the original deleted, its manifest first (``quarantine.store_copied``,
        ``quarantine.store_manifest_deleted``, ``quarantine.store_removed``)."""

    @abstractmethod
    def finish_move(self, source: Location, target: Location) -> bool:
        """Rank 0, on open: finish a :meth:`move_aside` of ``source`` (still there) that a crash interrupted;
        returns whether ``source`` is gone now. Left alone: on disk, a ``target`` that exists (which is which is
        not known); in a store, a prefix a save claims (a new save of that step)."""

    @abstractmethod
    def move_file(self, source: Location, target: Location) -> None:
        """Move the small file ``source`` (a signature) to ``target`` beside it, durably."""

    @abstractmethod
    def remove(self, checkpoint: Location, *, companions: Sequence[Location] = ()) -> None:
        """Rank 0: delete a committed checkpoint after its tombstone row, and the ``companions`` beside it (its
        signature). On disk: renamed to a hidden ``.step-N.deleting-<hex>`` first (``retention.renamed``), the
        companions (``retention.signature_removed``), then removed (``retention.removed``). In a store: the
        manifest first (``retention.store_manifest_deleted``), the companions, the rest
        (``retention.store_removed``). A crash leaves nothing that is listed as committed, or a checkpoint the
        tombstone names that the next pass deletes."""

    @abstractmethod
    def half_removed(self, directory: Location) -> list[Location]:
        """Checkpoint-named entries of ``directory`` a removal a crash interrupted may have left under their own
        name, with no commit record (a store; on disk a removal renames first, so none)."""
