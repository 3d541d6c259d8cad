"""The checkpoint store of a local (or network) file system: temp directory, fsync, one atomic rename.

See :mod:`.protocol` for what each operation promises; the durable steps themselves (fsync, atomic
small writes, temp names and their locks) are :mod:`.fsutil`'s.

Note: what a crash leaves on disk, and who clears it. A save writes into ``.step-N.tmp-<hex>``
(locked by its process until it ends) and commits by renaming it to ``step-N``; a removal renames
``step-N`` to ``.step-N.deleting-<hex>`` before deleting it; ``latest`` is replaced through a
``.latest.tmp-<hex>`` file. Each hidden name is removed when a manager opens the directory
(:meth:`LocalStore.open_directory`) unless a live save holds its lock, so a crash at any point
leaves either the old state or the new one, plus garbage nothing lists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, cast

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.faults.observer import SaveObserver, SavePhase
from shardline.checkpoint.storage.calibration import SaveTuning, tuning_for
from shardline.checkpoint.storage.fsutil import (
    atomic_write_bytes,
    fsync_dir,
    fsync_new_dirs,
    fsync_together,
    is_tmp_lock_name,
    is_tmp_name,
    is_trash_name,
    lock_tmp,
    release_tmp,
    tmp_dir_for,
    tmp_in_use,
    trash_dir_for,
    write_unflushed,
)
from shardline.checkpoint.storage.key_prefixes import flat_prefix
from shardline.checkpoint.storage.protocol import (
    CHECKPOINT_NAME,
    COMMIT_RECORD,
    CheckpointStore,
    Cleared,
    CommitRecord,
    Location,
    SaveFiles,
)
from shardline.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError

__all__ = ["LATEST_FILE", "LocalFiles", "LocalStore", "clear_latest", "read_latest", "write_latest"]

log = logging.getLogger(__name__)

LATEST_FILE = "latest"
"""The text file in a directory of checkpoints naming the newest regular one (``step-200``)."""
_DCP_METADATA = ".metadata"  # DCP's own index file: a plain DCP directory is loadable at verify="none"


def read_latest(directory: Path) -> Path | None:
    """The checkpoint the ``latest`` file of ``directory`` names, or None."""
    try:
        name = (directory / LATEST_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return directory / name if name and CHECKPOINT_NAME.match(name) else None


def write_latest(directory: Path, checkpoint: Path) -> None:
    """Point ``latest`` at ``checkpoint`` (atomically; crash points ``latest.tmp_written``, ``latest.replaced``)."""
    atomic_write_bytes(directory / LATEST_FILE, f"{checkpoint.name}\n".encode(), crash_name="latest")


def clear_latest(directory: Path) -> None:
    """Remove ``latest`` (no regular checkpoint is left for it to name)."""
    (directory / LATEST_FILE).unlink(missing_ok=True)
    fsync_dir(directory)


def _write_new(path: Path, data: bytes) -> Path:
    """A new file (never over an existing one: ``FileExistsError``), written, not yet flushed."""
    with open(path, "xb") as f:
        f.write(data)
    return path


class LocalFiles(SaveFiles):
    """A save's files on a local file system, as DCP's own ``FileSystem`` addresses them (``Path`` objects)."""

    fsync = True
    uploads = False

    def __init__(self, root: str | os.PathLike[str] = "") -> None:
        self.root = root

    def data_prefix(self, rank: int) -> str:
        return flat_prefix(rank)  # a directory of many files costs nothing per name (see key_prefixes.py)

    def open_write(self, path: str) -> BinaryIO:
        return open(path, "wb")

    def tuning(self, *, writers: int, cores: int) -> SaveTuning:
        # Measured where the files go (the save's temporary directory), once per file system and host: calibration.py.
        return tuning_for(Path(self.root), writers=writers, cores=cores)

    def written(self, path: str) -> None:
        return None

    def join(self, path: str | os.PathLike[str], name: str) -> str | os.PathLike[str]:
        return Path(path) / name

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return Path(path).exists()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        Path(path).rename(new_path)

    def remove(self, path: str | os.PathLike[str]) -> None:
        Path(path).unlink()


class LocalStore(CheckpointStore):
    """Checkpoints on a local (or shared network) file system; see the module note."""

    place = "on disk"
    absent = "no such directory"

    # ------------------------------------------------------------------ naming, access, messages
    def describe(self, location: Location) -> str:
        return str(location)

    def describe_directory(self, directory: Location) -> str:
        return str(directory)

    def short_name(self, location: Location) -> str:
        return location.name

    def ledger_name(self, location: Location, *, relative_to: Path) -> str:
        return os.path.relpath(_path(location), relative_to)

    def check_access(self, location: Location) -> None:
        return None

    def copy_command(self, location: Location | str, into: str, *, recursive: bool, note: bool = False) -> str | None:
        return None

    # ------------------------------------------------------------------ reading
    def snapshot(self, location: Location) -> Location:
        return _path(location)

    def open_read(self, file: Location) -> BinaryIO:
        return open(_path(file), "rb", buffering=0)

    def local_file(self, location: Location) -> Path | None:
        return _path(location)

    @contextlib.contextmanager
    def local_copy(self, location: Location) -> Iterator[Path]:
        yield _path(location)

    def put(self, location: Location, data: bytes) -> None:
        path = _path(location)
        tmp = path.with_name(f".{path.name}.tmp-{os.urandom(6).hex()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    # ------------------------------------------------------------------ a directory of checkpoints
    def names(self, directory: Location) -> set[str]:
        return set(os.listdir(_path(directory))) if _path(directory).is_dir() else set()

    def is_taken(self, listing: set[str], name: str) -> bool:
        return name in listing

    def may_hold_checkpoints(self, directory: Location) -> bool:
        return _path(directory).is_dir()

    def still_there(self, checkpoint: Location) -> bool:
        return _path(checkpoint).exists()

    def find_checkpoint(self, location: Location, *, given: str, directory: Location) -> Location:
        path: Location = location
        if not path.exists() and (directory / str(path)).exists():
            path = directory / str(path)
        path = path.absolute()
        if not path.is_dir():
            raise CheckpointNotFoundError(f"cannot resume from {given}: no such checkpoint directory")
        if is_tmp_name(path.name):
            raise CheckpointNotFoundError(
                f"cannot resume from {path}: it is the temporary directory of a save that never committed"
            )
        if not (path / COMMIT_RECORD).is_file() and not (path / _DCP_METADATA).is_file():
            raise CheckpointNotFoundError(
                f"cannot resume from {path}: it is not a committed checkpoint (no {COMMIT_RECORD} and no "
                f"{_DCP_METADATA})"
            )
        return path

    def open_directory(self, directory: Location) -> None:
        directory = _path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for child in sorted(directory.iterdir()):
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

    def clear_leftovers(self, directory: Location, *, committed: set[str], run: str | None) -> list[Cleared]:
        return []  # open_directory removed them: a temporary directory is never a checkpoint, whatever the ledger

    def read_latest(self, directory: Location, *, newest: Callable[[], Location | None]) -> Location | None:
        return read_latest(_path(directory))

    def write_latest(self, directory: Location, checkpoint: Location) -> None:
        write_latest(_path(directory), _path(checkpoint))

    def repoint_latest(
        self, directory: Location, *, newest: Callable[[], Location | None], only_from: Location | None = None
    ) -> bool:
        directory = _path(directory)
        current = read_latest(directory)
        if only_from is not None and current != only_from:
            return False
        target = newest()
        if target is not None:
            if current == target:
                return False
            write_latest(directory, _path(target))
            return True
        if (directory / LATEST_FILE).exists():
            clear_latest(directory)
            return True
        return only_from is not None

    # ------------------------------------------------------------------ a save
    def prepare(self, final: Location, *, run: Callable[[], str | None] | None = None) -> tuple[str, str | None]:
        final = _path(final)
        if final.exists() or final.is_symlink():
            raise CheckpointExistsError(
                f"checkpoint directory {final} already exists; shardline never overwrites a checkpoint. Save under a "
                "new step or path, or move the old one away first."
            )
        parent = final.parent
        existed = parent
        while not existed.exists() and existed.parent != existed:
            existed = existed.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            if existed != parent:  # new directories: their names must survive a crash like the checkpoint's
                fsync_new_dirs(parent, existed=existed)
        except OSError as e:
            raise CheckpointError(
                f"cannot create the checkpoint parent directory {parent}: {e.strerror or e}. Choose a writable "
                "location."
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
            lock_tmp(tmp)  # held until the save ends, so no other process takes the directory for a leftover
            tmp.mkdir()
        except OSError as e:
            release_tmp(tmp)
            raise CheckpointError(f"cannot create {tmp}: {e.strerror or e}. Choose a writable location.") from None
        crash_point("save.tmp_created")
        return tmp.name, None

    def check_writable(self, in_progress: Location, *, prepared_here: bool) -> None:
        tmp = _path(in_progress)
        if not (tmp.is_dir() and os.access(tmp, os.W_OK | os.X_OK)):
            raise CheckpointError(
                f"cannot see or write {tmp}, which rank 0 created: the checkpoint directory must be on a file system "
                "shared by all ranks (or writable by every rank's user). Nothing was written."
            )

    def save_files(self, in_progress: Location) -> SaveFiles:
        return LocalFiles(_path(in_progress))

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
        tmp, final = _path(in_progress), _path(final)
        # Nothing in tmp counts until the rename, so the records are written first and flushed together with
        # the files written unflushed and tmp's entries, before it: one journal commit rather than six.
        # Note: each record stays open from its write to its flush (on an fsync thread, which closes it): one
        # open per record, not a second one to flush it.
        opened: list[int] = []
        try:
            for record in records:
                opened.append(write_unflushed(tmp / record.name, record.data))
                if record.written:
                    crash_point(record.written)
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        fsync_together(files=[tmp / name for name in flush], directories=[tmp], opened=opened)
        wait_synced()
        crash_point("save.sums_written")
        observer.on_phase(SavePhase.AFTER_MANIFEST, 0)
        if final.exists() or final.is_symlink():
            raise CheckpointExistsError(
                f"{final} appeared while the checkpoint was being written; it was left untouched"
            )
        os.rename(tmp, final)
        on_commit()
        crash_point("save.renamed")
        fsync_dir(final.parent)
        crash_point("save.committed")
        observer.on_phase(SavePhase.AFTER_RENAME, 0)

    def commit_in_place(self, location: Location, *, records: Sequence[CommitRecord]) -> None:
        root = _path(location)
        manifest = next(r for r in records if r.name == COMMIT_RECORD)
        written = []
        try:
            for record in records:
                if record is not manifest:
                    written.append(_write_new(root / record.name, record.data))
            fsync_together(files=written, directories=[root])
            # Note: written under a hidden name and linked to its own, so the manifest appears whole and never
            # replaces one that another process committed meanwhile (a rename would replace it).
            tmp = root / f".{COMMIT_RECORD}.tmp-{os.urandom(6).hex()}"
            try:
                fsync_together(files=[_write_new(tmp, manifest.data)], directories=[])
                os.link(tmp, root / COMMIT_RECORD)
            finally:
                tmp.unlink(missing_ok=True)
        except FileExistsError as e:
            raise CheckpointExistsError(
                f"{root} gained {Path(e.filename or COMMIT_RECORD).name} while it was being adopted: another process "
                "committed it; it was left as it is"
            ) from None
        fsync_dir(root)

    def discard(self, in_progress: Location) -> None:
        shutil.rmtree(_path(in_progress), ignore_errors=True)
        release_tmp(_path(in_progress))

    def end_save(self, in_progress: Location) -> None:
        release_tmp(_path(in_progress))  # renamed or removed by now (a no-op where this process holds no lock)

    def refusal(self, final: Location, error: BaseException, *, previous: str) -> str | None:
        return None  # a refused write on disk (EACCES, EROFS) is named by its own error

    def free_bytes(self, directory: Location) -> int | None:
        try:
            return shutil.disk_usage(_path(directory)).free
        except OSError:
            return None

    def holder(self, final: Location) -> str | None:
        return None  # a save in progress holds a hidden temporary directory, never the final name

    # ------------------------------------------------------------------ moving and removing checkpoints
    def move_aside(self, path: Location, target: Location) -> None:
        path, target = _path(path), _path(target)
        os.rename(path, target)
        fsync_dir(path.parent)
        crash_point("quarantine.moved")

    def finish_move(self, source: Location, target: Location) -> bool:
        source, target = _path(source), _path(target)
        if source.is_dir() and not target.exists():
            log.warning("finishing the move of %s to %s, which a crash interrupted", source.name, target.name)
            self.move_aside(source, target)
        return not source.exists()

    def move_file(self, source: Location, target: Location) -> None:
        source, target = _path(source), _path(target)
        os.rename(source, target)
        fsync_dir(source.parent)

    def remove(self, checkpoint: Location, *, companions: Sequence[Location] = ()) -> None:
        path = _path(checkpoint)
        trash = trash_dir_for(path)
        os.rename(path, trash)
        fsync_dir(path.parent)
        crash_point("retention.renamed")
        for companion in companions:
            if companion.is_file():
                _path(companion).unlink()
                crash_point("retention.signature_removed")
        shutil.rmtree(trash)
        crash_point("retention.removed")

    def half_removed(self, directory: Location) -> list[Location]:
        return []  # a removal renames first: what it leaves is hidden, and open_directory removes it


def _path(location: Location | str | os.PathLike[str]) -> Path:
    """``location`` as the ``Path`` it is (the local store only ever receives local locations)."""
    return location if isinstance(location, Path) else Path(os.fspath(cast("str | os.PathLike[str]", location)))
