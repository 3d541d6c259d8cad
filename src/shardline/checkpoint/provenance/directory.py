"""A directory of checkpoints: names, which ones are committed, the ``latest`` pointer, moving one aside.

Layout::

    step-100/  step-200/                 committed checkpoints (regular saves)
    step-250-on_exception/               a checkpoint saved when training raised (tag "on_exception")
    step-300.damaged-20250101T120000Z/   a checkpoint that failed verification on resume, moved aside
    .step-300.tmp-<hex>/                 a save in progress (or one that crashed): never resumed from
    latest                               text file naming the newest regular checkpoint ("step-200"; on disk
                                         only: in an object store the store derives it, see storage/)

Only ``step-N`` / ``step-N-TAG`` directories with a ``manifest.json`` count as committed.
Which one is newest is the ledger's to say (:func:`shardline.checkpoint.provenance.lineage.order`), not
the creation time a manifest records: clocks differ between nodes.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from shardline.checkpoint.integrity.manifest import MANIFEST, read_manifest
from shardline.checkpoint.storage.fsutil import fsync_dir
from shardline.checkpoint.storage.local import LATEST_FILE, clear_latest, read_latest, write_latest
from shardline.checkpoint.storage.protocol import CHECKPOINT_NAME, Location, is_checkpoint_name
from shardline.errors import CheckpointNotFoundError, IntegrityError

__all__ = [
    "CHECKPOINTS_DIR",
    "LATEST_FILE",
    "CommittedCheckpoint",
    "DamagedCheckpoint",
    "aside_path",
    "checkpoint_name",
    "clear_latest",
    "is_checkpoint_name",
    "move_aside",
    "read_latest",
    "scan",
    "step_of",
    "step_recorded",
    "write_latest",
]

CHECKPOINTS_DIR = "checkpoints"
"""The folder of a run directory that holds its checkpoints (``shardline train`` writes ``RUN_DIR/checkpoints``)."""
_NAME = CHECKPOINT_NAME


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint found in a directory (its manifest read and checked against ``manifest.sha256``)."""

    path: Location
    step: int
    tag: str | None
    manifest_hash: str
    created_unix_ns: int
    parent_manifest_hash: str | None
    world_size: int


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A ``step-N`` directory with a manifest that does not verify (``reason`` says how)."""

    path: Location
    step: int
    reason: str


def checkpoint_name(step: int, tag: str | None = None) -> str:
    """``step-N`` or ``step-N-TAG``."""
    return f"step-{step}" if tag is None else f"step-{step}-{tag}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name (``step-40``, ``step-40-on_exception``), None for other names."""
    match = _NAME.match(name)
    return int(match["step"]) if match else None


def scan(
    directory: Location, *, known: Callable[[Location], CommittedCheckpoint | None] | None = None
) -> tuple[list[CommittedCheckpoint], list[DamagedCheckpoint]]:
    """Committed checkpoints (by step, then name: the ledger orders them, see the module note) and ``step-N``
    directories whose manifest is damaged. Directories without a manifest are neither.

    ``known``: a ``step-N`` directory as the ledger records it, when its manifest's bytes prove it is that one
    (:func:`.recorded_heads.from_ledger`), so its 131k-entry file list is not parsed; None reads it whole.

    Raises:
        CheckpointReadError: a manifest could not be read (an I/O error, a permission): that is not
            damage, so it is not reported as such.
    """
    found: list[CommittedCheckpoint] = []
    damaged: list[DamagedCheckpoint] = []
    if not directory.is_dir():
        return found, damaged
    for child in directory.iterdir():
        match = _NAME.match(child.name)
        if not match or not child.is_dir():
            continue
        recorded = known(child) if known is not None else None
        if recorded is not None:
            found.append(recorded)
            continue
        try:
            manifest, digest = read_manifest(child)
        except CheckpointNotFoundError:
            continue
        except IntegrityError as e:
            damaged.append(DamagedCheckpoint(child, int(match["step"]), str(e)))
            continue
        found.append(
            CommittedCheckpoint(
                path=child,
                step=int(manifest.get("step", str(match["step"]))),  # str(): typeshed types a group as str | Any
                tag=manifest.get("tag"),
                manifest_hash=digest,
                created_unix_ns=int(manifest.get("created_unix_ns", 0)),
                parent_manifest_hash=manifest.get("parent_manifest_sha256"),
                world_size=int(manifest.get("world_size", 0)),
            )
        )
    return sorted(found, key=lambda c: (c.step, c.path.name)), sorted(damaged, key=lambda d: d.step)


def aside_path(path: Location) -> Location:
    """A free ``<name>.damaged-<UTC time>`` beside ``path``: where a checkpoint that fails verification goes.

    The name is not a checkpoint name, so nothing resumes from it and a later save of the same
    step does not collide with it.
    """
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
        n += 1
    return target


def move_aside(path: Path, target: Path | None = None) -> Path:
    """Rename a local directory to ``target`` (default :func:`aside_path`) beside it; return the new path.

    A manager moves a checkpoint aside through its store (:meth:`.CheckpointStore.move_aside`); this is for
    callers that move local folders of their own (a Trainer's run folder).
    """
    # Beside a local path, the free name is a local path too.
    target = target or cast(Path, aside_path(path))
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def has_manifest(path: Location) -> bool:
    """Whether ``path`` holds a ``manifest.json`` (a shardline checkpoint, committed or damaged)."""
    return (path / MANIFEST).is_file()


def step_recorded(path: Location) -> int:
    """The step ``path``'s manifest records (0 for a plain DCP directory)."""
    return int(read_manifest(path)[0]["step"]) if has_manifest(path) else 0
