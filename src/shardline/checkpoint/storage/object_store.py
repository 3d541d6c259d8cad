"""The checkpoint store of an object store (``s3://bucket/prefix``): a claim, uploads in place, the manifest last.

See :mod:`.protocol` for what each operation promises, :mod:`.objects` for the locations
themselves, :mod:`.claims` for the claim a save takes on its prefix and
:mod:`.object_leftovers` for clearing what a save that died left.

Note: what a bucket lacks, and what the protocol does instead.

* No atomic rename: a save writes under its final prefix ``step-N/`` and ``manifest.json`` --
  uploaded last, with ``If-None-Match: *``, once every object it lists is acknowledged -- is the
  commit record. A prefix without one is never listed, loaded or resumed.
* No fsync: an upload is durable when the store acknowledges it.
* No atomic replace of a pointer either, so ``latest`` is not stored: it is the newest regular
  committed checkpoint by the ledger, which cannot disagree with the commit records.
* A move is a server-side copy, then the original deleted, its manifest first; a removal
  deletes the manifest first, then the rest. Between the two the prefix is not a checkpoint,
  and the ledger row written before either (``quarantine``, ``tombstone``) says what to finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import shlex
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.faults.observer import SaveObserver, SavePhase
from shardline.checkpoint.storage import claims
from shardline.checkpoint.storage.key_prefixes import spread_prefix
from shardline.checkpoint.storage.object_leftovers import clear_store_leftovers
from shardline.checkpoint.storage.objects import ObjectPath, check_access, delete_object, describe
from shardline.checkpoint.storage.protocol import (
    COMMIT_RECORD,
    CheckpointStore,
    Cleared,
    CommitRecord,
    Location,
    SaveFiles,
    is_checkpoint_name,
)
from shardline.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    SignatureError,
    error_chain,
)

__all__ = ["ObjectFiles", "ObjectStore"]

log = logging.getLogger(__name__)


class ObjectFiles(SaveFiles):
    """A save's files uploaded through fsspec: DCP addresses them by bucket-relative key ("bucket/prefix/name")."""

    fsync = False
    uploads = True

    def __init__(self, fs: Any, root: str) -> None:
        self._fs = fs
        self.root = root

    def data_prefix(self, rank: int) -> str:
        return spread_prefix(rank)  # S3's request rates are per key prefix (see key_prefixes.py)

    def open_write(self, path: str) -> BinaryIO:
        file: BinaryIO = self._fs.open(path, "wb")  # an fsspec file: the upload completes when it is closed
        return file

    def written(self, path: str) -> None:
        crash_point("save.store_uploaded")

    def join(self, path: str | os.PathLike[str], name: str) -> str:
        return posixpath.join(str(path), name)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        return None  # an object store has no directories to make

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self._fs.exists(str(path)))

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self._fs.copy(str(path), str(new_path))  # DCP's .metadata: a server-side copy, then a delete
        crash_point("save.store_metadata_copied")
        delete_object(self._fs, str(path))

    def remove(self, path: str | os.PathLike[str]) -> None:
        delete_object(self._fs, str(path))


class ObjectStore(CheckpointStore):
    """Checkpoints in an object store through fsspec; see the module note."""

    place = "in the object store"
    absent = "no object under that prefix"

    # ------------------------------------------------------------------ naming, access, messages
    def describe(self, location: Location) -> str:
        return describe(location)

    def describe_directory(self, directory: Location) -> str:
        return f"the bucket prefix {directory}/ (endpoint {_objects(directory).endpoint})"

    def short_name(self, location: Location) -> str:
        return str(location)

    def ledger_name(self, location: Location, *, relative_to: Path) -> str:
        return str(location)

    def check_access(self, location: Location) -> None:
        check_access(location)

    def copy_command(self, location: Location | str, into: str, *, recursive: bool, note: bool = False) -> str | None:
        command = f"aws s3 cp{' --recursive' if recursive else ''} {shlex.quote(str(location))} {shlex.quote(into)}"
        return command + (f"   # with AWS_ENDPOINT_URL={_objects(location).endpoint}" if note else "")  # type: ignore[arg-type]

    # ------------------------------------------------------------------ reading
    def snapshot(self, location: Location) -> Location:
        # One listing answers every "present? what size?" (see objects.py), of the data files' prefixes too.
        return _objects(location).snapshot(deep=True)

    def open_read(self, file: Location) -> BinaryIO:
        return _objects(file).open("rb")  # ranged streaming reads

    def local_file(self, location: Location) -> Path | None:
        return None

    @contextlib.contextmanager
    def local_copy(self, location: Location) -> Iterator[Path]:
        prefix = _objects(location)
        with tempfile.TemporaryDirectory(prefix="shardline-copy-") as tmp:
            target = Path(tmp) / prefix.name
            keys = [str(k) for k in prefix.fs.find(prefix.key)]
            if not keys:
                raise SignatureError(
                    f"{prefix} holds no objects (endpoint {prefix.endpoint}): pass a checkpoint prefix such as "
                    f"{prefix}/step-N"
                )
            for key in keys:
                relative = posixpath.relpath(key, prefix.key)
                local = target if relative == "." else target.joinpath(*relative.split("/"))
                local.parent.mkdir(parents=True, exist_ok=True)
                prefix.fs.get_file(key, str(local))
            yield target

    def put(self, location: Location, data: bytes) -> None:
        _objects(location).write_bytes(data)  # one PUT: the object appears whole or not at all

    # ------------------------------------------------------------------ a directory of checkpoints
    def names(self, directory: Location) -> set[str]:
        return {child.name for child in _objects(directory).snapshot().iterdir()}

    def is_taken(self, listing: set[str], name: str) -> bool:
        return name in listing or name + claims.CLAIM_SUFFIX in listing

    def may_hold_checkpoints(self, directory: Location) -> bool:
        return True

    def still_there(self, checkpoint: Location) -> bool:
        return (_objects(checkpoint) / COMMIT_RECORD).exists()

    def find_checkpoint(self, location: Location, *, given: str, directory: Location) -> Location:
        if not (location / COMMIT_RECORD).is_file():
            raise CheckpointNotFoundError(
                f"cannot resume from {location}: it is not a committed checkpoint (no {COMMIT_RECORD} there)"
            )
        return location

    def open_directory(self, directory: Location) -> None:
        return None  # a prefix needs no creating; what dead saves left, the ledger judges (clear_leftovers)

    def clear_leftovers(self, directory: Location, *, committed: set[str], run: str | None) -> list[Cleared]:
        return clear_store_leftovers(_objects(directory), recorded=committed, run=run)

    def read_latest(self, directory: Location, *, newest: Callable[[], Location | None]) -> Location | None:
        return newest()  # derived from the commit records (see the module note)

    def write_latest(self, directory: Location, checkpoint: Location) -> None:
        return None

    def repoint_latest(
        self, directory: Location, *, newest: Callable[[], Location | None], only_from: Location | None = None
    ) -> bool:
        return False

    # ------------------------------------------------------------------ a save
    def prepare(self, final: Location, *, run: Callable[[], str | None] | None = None) -> tuple[str, str | None]:
        final = _objects(final)
        # One LIST of the parent both proves access and shows whether the checkpoint's prefix is taken; only
        # when it fails is the bucket itself checked, for an error that names what is wrong.
        try:
            parent = final.parent.snapshot()
        except Exception:
            check_access(final)
            raise
        if not parent.exists():  # an empty or new prefix, or no such bucket: which one, check_access says
            check_access(final)
        if (parent / final.name).exists():
            if (final / COMMIT_RECORD).is_file():
                raise CheckpointExistsError(
                    f"checkpoint {final} already exists (committed: it has a {COMMIT_RECORD}); shardline never "
                    "overwrites a checkpoint. Save under a new step or prefix, or resume from it."
                )
            if (parent / claims.claim_path(final).name).exists():
                raise CheckpointExistsError(claims.taken_message(final))
            raise CheckpointExistsError(
                f"{final} holds objects of a save that never committed (no {COMMIT_RECORD}), so nothing can be "
                f"resumed from it; shardline never writes into a prefix that is not empty. A CheckpointManager on "
                f"{final.parent} clears such a prefix when it opens, unless a live save holds its claim "
                f"({claims.claim_path(final).name}); or delete the objects under {final}/."
            )
        try:
            claims.claim(final, run=run() if run is not None else None)
        except CheckpointError:
            raise
        except Exception as e:  # the store failing (5xx, SlowDown past the client's retries, a lost connection)
            last = None
            with contextlib.suppress(Exception):
                last = claims.newest_committed(parent, final)
            previous = f"the last good checkpoint is {last}" if last else "no earlier checkpoint is known here"
            raise CheckpointError(
                f"claiming checkpoint {describe(final)} failed ({_first_line(e)}); no checkpoint was written; "
                f"{previous}"
            ) from e
        return final.name, claims.newest_committed(parent, final)

    def check_writable(self, in_progress: Location, *, prepared_here: bool) -> None:
        if not prepared_here:  # rank 0 has reached it already; the others check their own access
            check_access(in_progress)

    def save_files(self, in_progress: Location) -> SaveFiles:
        objects = _objects(in_progress)
        return ObjectFiles(objects.fs, objects.key)

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
        """See :meth:`.CheckpointStore.commit`.

        Note: an object store has no rename, so the data objects were written under their final
        prefix; what makes them a checkpoint is ``manifest.json``, uploaded last, once every object it
        lists (and the records derived from it) is acknowledged. Until then the prefix is not a
        checkpoint to anything that lists, loads or resumes. A PUT is atomic: readers see the whole
        manifest or none. The manifest goes up only while this save still holds its claim, and the
        claim is deleted after it (see :func:`.claims.claim`).
        """
        final = _objects(final)
        manifest = next(r for r in records if r.name == COMMIT_RECORD)
        # The records the manifest implies go up at once (concurrent PUTs); the manifest only after all of them.
        final.fs.pipe({(final / r.name).key: r.data for r in records if r.name != COMMIT_RECORD})
        wait_synced()
        crash_point("save.sums_written")
        observer.on_phase(SavePhase.AFTER_MANIFEST, 0)
        if not claims.holds(final):
            claims.finished(final)
            raise CheckpointExistsError(
                f"checkpoint {final} was not committed: this save's claim on it ({claims.claim_path(final)}) is gone "
                "or no longer this process's -- another run's CheckpointManager judged it stale and cleared the "
                "prefix, or another run saves there. Nothing of the other run was deleted. Give each run its own "
                "checkpoint.dir."
            )
        try:
            (final / COMMIT_RECORD).write_new(manifest.data)  # conditional: never over another run's commit
        except FileExistsError:
            with contextlib.suppress(Exception):
                claims.release(final)  # ours, if it still is; the objects under the prefix may be the other run's
            raise CheckpointExistsError(
                f"checkpoint {final} was committed by another run while this one was writing it (its manifest "
                "appeared first); this save was not committed and nothing of the other was deleted. Give each run "
                "its own checkpoint.dir."
            ) from None
        on_commit()
        crash_point("save.committed")
        observer.on_phase(SavePhase.AFTER_RENAME, 0)
        claims.finished(final)
        try:  # committed: the manifest, not the claim, now guards the prefix (the claim was ours just before it)
            claims.claim_path(final).unlink()
        except Exception as e:  # a claim beside a committed prefix is removed by the next manager on the directory
            log.warning("checkpoint %s committed; removing its claim failed (%s), the next open removes it", final, e)
        crash_point("save.store_claim_released")

    def commit_in_place(self, location: Location, *, records: Sequence[CommitRecord]) -> None:
        root = _objects(location)
        manifest = next(r for r in records if r.name == COMMIT_RECORD)
        root.fs.pipe({(root / r.name).key: r.data for r in records if r is not manifest})
        try:
            (root / COMMIT_RECORD).write_new(manifest.data)  # conditional: never over another commit
        except FileExistsError:
            raise CheckpointExistsError(
                f"{root} was committed by another process while it was being adopted (its {COMMIT_RECORD} "
                "appeared first); it was left as it is"
            ) from None

    def discard(self, in_progress: Location) -> None:
        in_progress = _objects(in_progress)
        # The store may be what failed; without a manifest the prefix is never a checkpoint anyway, and a claim
        # left behind is cleared as stale by the next manager on the directory (claims.judge).
        with contextlib.suppress(Exception):
            # never another run's objects: a save whose claim was cleared has nothing here
            if claims.holds(in_progress):
                in_progress.remove_tree()
                claims.release(in_progress)
        claims.finished(in_progress)

    def end_save(self, in_progress: Location) -> None:
        claims.finished(_objects(in_progress))  # committed or discarded by now: a claim left is no longer live

    def refusal(self, final: Location, error: BaseException, *, previous: str) -> str | None:
        refused = next((e for e in error_chain(error) if isinstance(e, PermissionError)), None)
        return None if refused is None else claims.refused_message(_objects(final), refused, previous)

    def free_bytes(self, directory: Location) -> int | None:
        return None

    def holder(self, final: Location) -> str | None:
        claim = claims.claim_path(_objects(final))
        return claims.describe_claim(claim) if claim.exists() else None

    # ------------------------------------------------------------------ moving and removing checkpoints
    def move_aside(self, path: Location, target: Location) -> None:
        """See :meth:`.CheckpointStore.move_aside`.

        Note: an object store has no rename. Every object is copied (server side) to the aside
        prefix, whose name is not a checkpoint name; then the original's ``manifest.json`` -- its
        commit record -- is deleted, so from that request on it is no longer listed or resumed, and
        the rest after it. A crash anywhere in between leaves the ``quarantine`` row (written first)
        and a source prefix that still exists: the next manager finishes that same move
        (:meth:`finish_move`) -- copies what is missing at the target, then deletes -- instead of
        failing the checkpoint again and moving it a second time under a new name.
        """
        path, target = _objects(path), _objects(target)
        fs = path.fs
        have = {str(k)[len(target.key) :].lstrip("/"): int(v.get("size") or 0) for k, v in _listing(target).items()}
        objects = _listing(path)
        for key, entry in sorted(objects.items()):
            name = key[len(path.key) :].lstrip("/")
            if have.get(name) != int(entry.get("size") or 0):
                fs.copy(key, f"{target.key}/{name}")
        crash_point("quarantine.store_copied")
        if f"{path.key}/{COMMIT_RECORD}" in objects:
            (path / COMMIT_RECORD).unlink()
        crash_point("quarantine.store_manifest_deleted")
        path.remove_tree()  # the rest, and the prefix itself (a store with directories keeps an empty one)
        crash_point("quarantine.store_removed")

    def finish_move(self, source: Location, target: Location) -> bool:
        source = _objects(source)
        if claims.claim_path(source).exists() or (source / claims.LEGACY_CLAIM).exists():
            return False  # a save holds the prefix (another run's, or a dead one's: cleared on open, object_leftovers)
        log.warning("finishing the move of %s to %s, which a crash interrupted", source, target.name)
        self.move_aside(source, target)
        return True

    def move_file(self, source: Location, target: Location) -> None:
        source, target = _objects(source), _objects(target)
        source.fs.copy(source.key, target.key)
        source.unlink()

    def remove(self, checkpoint: Location, *, companions: Sequence[Location] = ()) -> None:
        path = _objects(checkpoint)
        manifest = path / COMMIT_RECORD
        if manifest.is_file():
            manifest.unlink()  # in a bucket that keeps versions, every version (see ObjectPath.remove_tree)
        crash_point("retention.store_manifest_deleted")
        for companion in companions:
            if companion.is_file():
                _objects(companion).unlink()
        path.remove_tree()
        crash_point("retention.store_removed")

    def half_removed(self, directory: Location) -> list[Location]:
        return [
            child
            for child in _objects(directory).snapshot().iterdir()
            if is_checkpoint_name(child.name) and child.is_dir()
        ]


def _objects(location: Location) -> ObjectPath:
    """``location`` as the ``ObjectPath`` it is (this store only ever receives its own locations)."""
    if not isinstance(location, ObjectPath):
        raise TypeError(f"{location!r} is not an object-store location")
    return location


def _listing(prefix: ObjectPath) -> dict[str, dict[str, Any]]:
    """Every object under ``prefix`` (recursively): key -> its listing entry."""
    try:
        return {str(k): v for k, v in prefix.fs.find(prefix.key, detail=True).items() if v.get("type") != "directory"}
    except FileNotFoundError:
        return {}


def _first_line(error: BaseException) -> str:
    """The innermost error's type and first message line."""
    for e in error_chain(error):
        text = str(e).strip().splitlines()
        if type(e).__name__ != "CheckpointException":  # DCP's own text is a multi-line traceback dump
            return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return type(error).__name__
