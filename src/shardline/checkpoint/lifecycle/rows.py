"""The rows a :class:`~.manager.CheckpointManager` appends to its ledger: one function per kind of row.

A commit row for every committed checkpoint (one just saved, or one found committed and not yet
recorded after a crash: ``recovered``), a ``quarantine`` row before a checkpoint is moved aside,
and event rows (``resume`` at an opt-in verify level, ``restart``, ...). Retention's tombstones
are :mod:`~shardline.checkpoint.provenance.retention`'s.
"""

from __future__ import annotations

from typing import Any

from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.lifecycle.save import CheckpointInfo
from shardline.checkpoint.provenance.directory import CommittedCheckpoint, has_manifest, step_of
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow
from shardline.checkpoint.provenance.statement import STATEMENT_FILE, read_statement
from shardline.checkpoint.storage.protocol import Location
from shardline.errors import IntegrityError

__all__ = ["record_commit", "record_event", "record_quarantine", "step_recorded"]


def record_commit(ledger: Ledger, ckpt: CommittedCheckpoint | CheckpointInfo, *, recovered: bool) -> LedgerRow:
    """The commit row of a committed checkpoint (one found in the directory, or one just saved).

    Its ``detail`` names the provenance statement and that file's SHA-256, so the ledger chains the statements.
    """
    statement = getattr(ckpt, "provenance_sha256", None)
    if statement is None:
        try:
            found = read_statement(ckpt.path)
        except IntegrityError:
            found = None
        statement = found[1] if found else None
    return ledger.append(
        detail={"provenance": {"file": STATEMENT_FILE, "sha256": statement}} if statement else None,
        step=ckpt.step,
        tag=ckpt.tag,
        checkpoint=ledger.name_of(ckpt.path),
        manifest_sha256=ckpt.manifest_hash,
        parent_manifest_sha256=ckpt.parent_manifest_hash,
        world_size=ckpt.world_size,
        recovered=recovered,
    )


def record_quarantine(
    ledger: Ledger, path: Location, target: Location, *, recorded: str | None, reason: str
) -> LedgerRow:
    """The ``quarantine`` row, appended before anything is moved: where ``path`` goes (``moved_to``) and why."""
    return ledger.append(
        step=step_of(path.name) or 0,
        tag=None,
        checkpoint=ledger.name_of(target),
        manifest_sha256=recorded or "",
        parent_manifest_sha256=None,
        world_size=0,
        event="quarantine",
        detail={"checkpoint": ledger.name_of(path), "moved_to": ledger.name_of(target), "reason": reason},
    )


def record_event(
    ledger: Ledger,
    event: str,
    *,
    step: int,
    checkpoint: Location,
    manifest_hash: str | None,
    world_size: int,
    detail: dict[str, Any],
) -> LedgerRow:
    """An ``event`` row about ``checkpoint`` (the one loaded): ``resume`` at an opt-in level, ``restart``, ..."""
    return ledger.append(
        step=step,
        tag=None,
        checkpoint=ledger.name_of(checkpoint),
        manifest_sha256=manifest_hash or "",
        parent_manifest_sha256=None,
        world_size=world_size,
        event=event,
        detail=detail,
    )


def step_recorded(path: Location) -> int:
    """The step ``path``'s manifest records (0 for a plain DCP directory)."""
    return int(read_manifest(path)[0]["step"]) if has_manifest(path) else 0
