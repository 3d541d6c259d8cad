"""``CheckpointManager``: the run directory's checkpoints, ``latest`` pointer, ledger, resume and async saves.

Layout of ``directory``::

    step-100/  step-200/                 committed checkpoints (regular saves)
    step-250-on_exception/               a checkpoint saved when training raised (tag "on_exception")
    .step-300.tmp-<hex>/                 a save in progress (or one that crashed): never resumed from
    latest                               text file naming the newest regular checkpoint ("step-200")
    lineage.sqlite                       the hash-chained ledger (default location)

Note: what "newest" means. Checkpoints are ordered by the creation time their manifest
records (then by step), so after an explicit resume from an older checkpoint the branch
trained since is what ``auto`` resumes, not an abandoned one with a higher step. The commit
point of a save is the rename of its directory; ``latest`` and the ledger follow it. If a
crash falls between the rename and those updates, the checkpoint is still committed: the next
manager on the directory appends its ledger row (marked ``recovered``) and repoints ``latest``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardline import _torch_compat
from shardline.checkpoint import coord, fault
from shardline.checkpoint.fsutil import atomic_write_bytes, is_tmp_name
from shardline.checkpoint.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.load import load as load_checkpoint
from shardline.checkpoint.manifest import DCP_METADATA, MANIFEST, manifest_files, read_manifest
from shardline.checkpoint.save import CheckpointInfo, preflight, stage_agreed, write_and_commit
from shardline.checkpoint.verify import check_files
from shardline.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning, ConfigurationError

__all__ = ["LATEST_FILE", "ON_EXCEPTION", "CheckpointManager", "CommittedCheckpoint"]

log = logging.getLogger(__name__)

LATEST_FILE = "latest"
ON_EXCEPTION = "on_exception"
_NAME = re.compile(r"^step-(?P<step>\d+)(?:-(?P<tag>[a-z0-9_]+))?$")
_TAG = re.compile(r"^[a-z0-9_]+$")


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint found in the manager's directory."""

    path: Path
    step: int
    tag: str | None
    manifest_hash: str
    created_unix_ns: int
    parent_manifest_hash: str | None
    world_size: int


class CheckpointManager:
    """Saves ``directory/step-N`` checkpoints chained by parent manifest hash, with ``latest`` and a ledger.

    Every method that touches checkpoints is a collective: call it on every rank.

    Args:
        directory: Where checkpoints live (created if needed).
        ledger_path: The SQLite ledger (default ``directory/lineage.sqlite``).
        async_save: Write checkpoints in a background thread. ``save`` returns once the state is
            copied (staged); the next ``save``, ``wait`` or ``close`` waits for the write and
            raises its error, if any. The background thread talks over its own gloo group so
            its collectives never interleave with training's.
        process_group: Group of the ranks that save (default: the world).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        ledger_path: str | os.PathLike | None = None,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.directory = Path(directory).absolute()
        self.ledger = Ledger(Path(ledger_path).absolute() if ledger_path else self.directory / LEDGER_NAME)
        self.async_save = bool(async_save)
        self.parent_manifest_hash: str | None = None
        self._group = process_group
        self._io_group = process_group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last: CheckpointInfo | None = None
        self._rank = coord.group_rank(process_group)
        if self.async_save and coord.group_size(process_group) > 1:
            # Note: a dedicated group, created collectively here, so the background thread's
            # collectives cannot interleave with training's on the main group.
            timeout = _torch_compat.group_timeout(process_group)
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
            self._io_group = dist.new_group(ranks=ranks, backend="gloo", **kwargs)
        if self._rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._reconcile()

    # ------------------------------------------------------------------ discovery
    def path_for(self, step: int, tag: str | None = None) -> Path:
        """The directory a save at ``step`` with ``tag`` goes to: ``step-N`` or ``step-N-TAG``."""
        if tag is not None and not _TAG.match(tag):
            raise ConfigurationError(f"checkpoint tag must match [a-z0-9_]+, got {tag!r}")
        return self.directory / (f"step-{step}" if tag is None else f"step-{step}-{tag}")

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints in the directory, oldest first (damaged ones are skipped with a warning)."""
        found = []
        if not self.directory.is_dir():
            return found
        for child in self.directory.iterdir():
            match = _NAME.match(child.name)
            if not match or not child.is_dir():
                continue
            try:
                manifest, digest = read_manifest(child)
            except CheckpointNotFoundError:
                continue
            except CheckpointError as e:
                warnings.warn(f"skipping damaged checkpoint {child}: {e}", CheckpointWarning, stacklevel=2)
                continue
            found.append(
                CommittedCheckpoint(
                    path=child,
                    step=int(manifest.get("step", match["step"])),
                    tag=manifest.get("tag"),
                    manifest_hash=digest,
                    created_unix_ns=int(manifest.get("created_unix_ns", 0)),
                    parent_manifest_hash=manifest.get("parent_manifest_sha256"),
                    world_size=int(manifest.get("world_size", 0)),
                )
            )
        return sorted(found, key=lambda c: (c.created_unix_ns, c.step))

    def latest(self) -> Path | None:
        """The checkpoint the ``latest`` pointer names, or None."""
        try:
            name = (self.directory / LATEST_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return self.directory / name if name and _NAME.match(name) else None

    def _reconcile(self) -> None:
        """Rank 0: drop leftovers of crashed saves; ledger rows and ``latest`` for checkpoints committed
        just before a crash."""
        for child in self.directory.iterdir():
            if child.is_dir() and is_tmp_name(child.name):
                log.warning("removing %s, left by a checkpoint save that did not commit", child)
                shutil.rmtree(child, ignore_errors=True)
        committed = self.committed()
        known = self.ledger.manifest_hashes()
        for c in committed:
            if c.manifest_hash not in known:
                self._ledger_row(c, recovered=True)
        regular = [c for c in committed if c.tag is None]
        if regular and self.latest() != regular[-1].path:
            atomic_write_bytes(self.directory / LATEST_FILE, f"{regular[-1].path.name}\n".encode())

    def _resolve_on_rank0(self, resume: str | os.PathLike) -> str | None:
        if str(resume) == "auto":
            committed = self.committed()
            return str(committed[-1].path) if committed else None
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
        if not (path / MANIFEST).is_file():
            if (path / DCP_METADATA).is_file():
                return str(path)  # plain DCP: load() warns that it has no lineage
            raise CheckpointNotFoundError(
                f"cannot resume from {path}: it is not a committed checkpoint (no {MANIFEST} and no {DCP_METADATA})"
            )
        manifest, _ = read_manifest(path)
        problems, _ = check_files(path, manifest_files(manifest), "manifest")
        if problems:
            raise CheckpointNotFoundError(
                f"cannot resume from {path}: it does not match its manifest ({problems[0].path}: {problems[0].kind}, "
                f"{problems[0].detail}); run `shardline verify {path}`"
            )
        return str(path)

    def resolve(self, resume: str | os.PathLike | None) -> Path | None:
        """Which checkpoint to resume from (a collective; rank 0 decides and tells the others).

        ``None``/``"none"``: none. ``"auto"``: the newest committed checkpoint (an
        ``on_exception`` one is picked when it is newer than the newest regular one), or None
        if there is none. A path (or a name inside ``directory``): it must be a committed
        checkpoint (or a plain DCP directory, which loads with a no-lineage warning).

        Raises:
            CheckpointNotFoundError: an explicit path that is not a committed checkpoint.
        """
        if resume is None or str(resume).lower() in ("", "none", "false"):
            return None
        verdict: dict[str, Any] = {}
        if self._rank == 0:
            try:
                verdict = {"path": self._resolve_on_rank0(resume)}
            except CheckpointError as e:
                verdict = {"error": str(e)}
        verdict = coord.broadcast_object(verdict, self._group)
        if "error" in verdict:
            raise CheckpointNotFoundError(verdict["error"])
        return Path(verdict["path"]) if verdict["path"] else None

    # ------------------------------------------------------------------ save / load
    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        state: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        data_fingerprint: str | None = None,
        tag: str | None = None,
        kind: str = "sharded",
    ) -> CheckpointInfo | None:
        """Save ``directory/step-N`` (or ``step-N-TAG``), chained to the previous checkpoint (a collective).

        Waits for the previous async save first (raising its error). Synchronous: returns the
        :class:`CheckpointInfo`. Async: returns None once staged; :meth:`wait` returns the info.
        """
        self.wait()
        path = self.path_for(step, tag)
        tmp = preflight(path, process_group=self._io_group)
        staged = stage_agreed(
            tmp,
            process_group=self._io_group,
            path=path,
            model=model,
            optimizer=optimizer,
            state=state,
            step=step,
            config=config,
            data_fingerprint=data_fingerprint,
            parent_manifest_hash=self.parent_manifest_hash,
            kind=kind,
            tag=tag,
            copy=self.async_save,
        )
        if not self.async_save:
            return self._write(staged, tmp)
        self._thread = threading.Thread(
            target=self._write_in_background, args=(staged, tmp), name=f"shardline-checkpoint-step-{step}", daemon=True
        )
        self._thread.start()
        return None

    def _write(self, staged: Any, tmp: Path) -> CheckpointInfo:
        info = write_and_commit(staged, tmp, process_group=self._io_group, after_commit=self._publish)
        self._last = info
        self.parent_manifest_hash = info.manifest_hash
        return info

    def _write_in_background(self, staged: Any, tmp: Path) -> None:
        try:
            self._write(staged, tmp)
        except BaseException as e:
            self._error = e

    def _publish(self, info: CheckpointInfo) -> None:
        """Rank 0, right after the commit: repoint ``latest`` (regular saves) and append the ledger row."""
        if info.tag is None:
            atomic_write_bytes(self.directory / LATEST_FILE, f"{info.path.name}\n".encode())
        fault.maybe_fail("after_latest", 0)
        self._ledger_row(info, recovered=False)

    def _ledger_row(self, ckpt: CommittedCheckpoint | CheckpointInfo, *, recovered: bool) -> None:
        """Append the ledger row of a committed checkpoint (one found on disk, or one just saved)."""
        self.ledger.append(
            step=ckpt.step,
            tag=ckpt.tag,
            checkpoint=os.path.relpath(ckpt.path, self.ledger.path.parent),
            manifest_sha256=ckpt.manifest_hash,
            parent_manifest_sha256=ckpt.parent_manifest_hash,
            world_size=ckpt.world_size,
            recovered=recovered,
        )

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
        """Wait for any async save (raising its error)."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load(
        self,
        resume: str | os.PathLike | None,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        verify: str = "manifest",
    ) -> dict[str, Any] | None:
        """Resolve ``resume`` (see :meth:`resolve`), load it, and chain the next save to it.

        Returns the trainer state (see :func:`shardline.checkpoint.load`), or None when there is
        nothing to resume from.
        """
        path = self.resolve(resume)
        if path is None:
            return None
        state = load_checkpoint(path, model=model, optimizer=optimizer, verify=verify, process_group=self._group)
        self.parent_manifest_hash = read_manifest(path)[1] if (path / MANIFEST).is_file() else None
        return state
