"""The ledger's rows, one operation per kind: every writer of lineage goes through here.

The :class:`~shardline.checkpoint.CheckpointManager`, retention, the Lightning strategy and the
Hugging Face Trainer record what happened to their checkpoints with these operations, never with
:meth:`.Ledger.append` itself, so each kind of row has one shape wherever it is written:

* :func:`record_commit` -- a committed checkpoint (just saved, or found committed and not yet
  recorded after a crash: ``recovered``), with a link to its provenance statement;
* :func:`record_adoption` -- a checkpoint another tool wrote, brought under lineage by ``adopt``: a
  commit row (so lineage, retention and the report treat it as any committed checkpoint) whose
  ``detail.adopted`` says its hashes were taken after the fact;
* :func:`record_quarantine` -- a checkpoint that failed verification, before it is moved aside;
* :func:`record_tombstone` -- a checkpoint deleted (or moved away) on purpose, with why;
* :func:`record_resume` -- a load that checked less than every byte (an opt-in verify level);
* :func:`record_restart` -- a run that restarted from a checkpoint, with its world sizes.

The ``chain_break`` row that opens a new chain is written by :meth:`.Ledger.start_new_chain`
itself (it is part of the switch to the new file). Rows are written on rank 0 only; a caller
that runs on every rank wraps the operation in
:func:`~shardline.checkpoint.coordination.coord.rank0_decides`, so an error reaches every rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from shardline.checkpoint.provenance.directory import step_of
from shardline.checkpoint.provenance.ledger import QUARANTINE, RESTART, RESUME, TOMBSTONE, Ledger, LedgerRow
from shardline.checkpoint.provenance.statement import STATEMENT_FILE, read_statement
from shardline.checkpoint.storage.protocol import Location
from shardline.errors import IntegrityError

__all__ = [
    "Committed",
    "adoption",
    "commit_row",
    "record_adoption",
    "record_commit",
    "record_quarantine",
    "record_restart",
    "record_resume",
    "record_tombstone",
]


class Committed(Protocol):
    """A committed checkpoint as a row needs it (a save's ``CheckpointInfo``, or one found in a directory)."""

    @property
    def path(self) -> Location: ...
    @property
    def step(self) -> int: ...
    @property
    def tag(self) -> str | None: ...
    @property
    def manifest_hash(self) -> str: ...
    @property
    def parent_manifest_hash(self) -> str | None: ...
    @property
    def world_size(self) -> int: ...


def commit_row(
    ledger: Ledger,
    checkpoint: Committed,
    *,
    recovered: bool,
    statement: bool = True,
    metrics: Mapping[str, str] | None = None,
    keep_best: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields of ``checkpoint``'s commit row (keyword arguments of :meth:`.Ledger.append`).

    With ``statement``, ``detail`` names the checkpoint's provenance statement and that file's SHA-256
    (the one the save reported, else the one read from the checkpoint), so the ledger chains the statements,
    and ``held``: the file count and bytes a save's ``CheckpointInfo`` reports (what a tombstone of it records,
    served without parsing its manifest, :mod:`.recorded_heads`; absent for a checkpoint found on disk).
    ``metrics`` (each value as text) and the best-k policy ``keep_best`` go into ``detail`` when given
    (:mod:`.best`).
    """
    detail = _statement_link(checkpoint) if statement else None
    extra = {
        "held": _held(checkpoint) if statement else None,
        "metrics": dict(metrics) if metrics else None,
        "keep_best": dict(keep_best) if keep_best else None,
    }
    if any(v is not None for v in extra.values()):
        detail = {**(detail or {}), **{key: value for key, value in extra.items() if value is not None}}
    return {
        "step": checkpoint.step,
        "tag": checkpoint.tag,
        "checkpoint": ledger.name_of(checkpoint.path),
        "manifest_sha256": checkpoint.manifest_hash,
        "parent_manifest_sha256": checkpoint.parent_manifest_hash,
        "world_size": checkpoint.world_size,
        "recovered": recovered,
        "detail": detail,
    }


def record_commit(
    ledger: Ledger,
    checkpoint: Committed,
    *,
    recovered: bool,
    statement: bool = True,
    metrics: Mapping[str, str] | None = None,
    keep_best: Mapping[str, Any] | None = None,
) -> LedgerRow:
    """Append the commit row of ``checkpoint`` (see :func:`commit_row`).

    Note: ``statement=False`` is for the Lightning strategy's and the Hugging Face Trainer's rows, which have
    never linked the statement; their rows keep the shape they always had.
    """
    fields = commit_row(
        ledger, checkpoint, recovered=recovered, statement=statement, metrics=metrics, keep_best=keep_best
    )
    return ledger.append(**fields)


def record_adoption(ledger: Ledger, checkpoint: Committed, *, at: str, hashes: str) -> LedgerRow:
    """The commit row of a checkpoint another tool wrote, adopted at ``at`` (UTC): ``detail.adopted`` records
    when, and what its hashes prove (``hashes``: taken after the fact, not while writing).

    Note: a commit row, not an event of its own, so that the chain, ``latest``, retention, ``lineage`` and
    the report need nothing new to count it as committed; ``detail.adopted`` is what sets it apart.
    """
    fields = commit_row(ledger, checkpoint, recovered=False, statement=False)
    fields["detail"] = {"adopted": {"at": at, "hashes": hashes}}
    return ledger.append(**fields)


def adoption(row: LedgerRow) -> dict[str, Any] | None:
    """``detail.adopted`` of a commit row written by :func:`record_adoption` (None for any other row)."""
    if not row.is_commit or not row.detail:
        return None
    try:
        detail = json.loads(row.detail)
    except ValueError:
        return None
    found = detail.get("adopted") if isinstance(detail, dict) else None
    return found if isinstance(found, dict) else None


def record_quarantine(
    ledger: Ledger, *, checkpoint: Location, moved_to: Location, recorded: str | None, reason: str
) -> LedgerRow:
    """The ``quarantine`` row, appended before anything is moved: where ``checkpoint`` goes and why.

    ``recorded`` is the manifest hash the ledger records for it (None: not recorded).
    """
    return ledger.append(
        step=step_of(checkpoint.name) or 0,
        tag=None,
        checkpoint=ledger.name_of(moved_to),
        manifest_sha256=recorded or "",
        parent_manifest_sha256=None,
        world_size=0,
        event=QUARANTINE,
        detail={"checkpoint": ledger.name_of(checkpoint), "moved_to": ledger.name_of(moved_to), "reason": reason},
    )


def record_tombstone(
    ledger: Ledger,
    *,
    of: Committed | LedgerRow,
    checkpoint: str,
    reason: str,
    held: Mapping[str, Any] | None = None,
    keep_last_n: int | None = None,
    keep_best_k: int | None = None,
    newer: str | None = None,
    moved_to: str | None = None,
    commit_row: int | None = None,
) -> LedgerRow:
    """The ``tombstone`` row of the checkpoint the ledger names ``checkpoint``, deleted (or moved away) on purpose.

    ``of`` is that checkpoint as found on disk, or its commit row; the row repeats its step, tag and hashes.
    The detail holds ``checkpoint`` and ``reason``, and each of these that is given: what it ``held`` (files,
    bytes, its statement and signature), the retention policy that deleted it (``keep_last_n``, ``keep_best_k``, and the
    ``newer`` checkpoint whose commit triggered it), where it was ``moved_to``, and its ``commit_row``.
    """
    if isinstance(of, LedgerRow):
        manifest, parent = of.manifest_sha256, of.parent_manifest_sha256
    else:
        manifest, parent = of.manifest_hash, of.parent_manifest_hash
    detail: dict[str, Any] = {"checkpoint": checkpoint, "reason": reason}
    facts = {
        "keep_last_n": keep_last_n,
        "keep_best_k": keep_best_k,
        "newer": newer,
        "moved_to": moved_to,
        "commit_row": commit_row,
    }
    detail.update({key: value for key, value in facts.items() if value is not None})
    detail.update(held or {})
    return ledger.append(
        step=of.step,
        tag=of.tag,
        checkpoint=checkpoint,
        manifest_sha256=manifest,
        parent_manifest_sha256=parent,
        world_size=of.world_size,
        event=TOMBSTONE,
        detail=detail,
    )


def record_resume(
    ledger: Ledger, *, checkpoint: Location, step: int, manifest_hash: str | None, world_size: int, verify: str
) -> LedgerRow:
    """The ``resume`` row: a load of ``checkpoint`` that checked less than every byte (``verify``, its level)."""
    return _event_row(
        ledger,
        RESUME,
        checkpoint=checkpoint,
        step=step,
        manifest_hash=manifest_hash,
        world_size=world_size,
        detail={"checkpoint": ledger.name_of(checkpoint), "verify": verify},
    )


def record_restart(
    ledger: Ledger,
    *,
    checkpoint: Location,
    step: int,
    manifest_hash: str | None,
    world_size: int,
    world_size_before: int | None,
    world_size_after: int,
    cause: str,
    elastic_restart: int = 0,
) -> LedgerRow:
    """The ``restart`` row: a run restarted from ``checkpoint`` at ``step``, its world sizes, the cause as far as it
    is known, and torchrun's restart count where it is not 0."""
    detail: dict[str, Any] = {
        "checkpoint": ledger.name_of(checkpoint),
        "world_size_before": world_size_before,
        "world_size_after": world_size_after,
        "cause": cause,
    }
    if elastic_restart:
        detail["elastic_restart"] = elastic_restart
    return _event_row(
        ledger,
        RESTART,
        checkpoint=checkpoint,
        step=step,
        manifest_hash=manifest_hash,
        world_size=world_size,
        detail=detail,
    )


def _event_row(
    ledger: Ledger,
    event: str,
    *,
    checkpoint: Location,
    step: int,
    manifest_hash: str | None,
    world_size: int,
    detail: dict[str, Any],
) -> LedgerRow:
    """An ``event`` row about ``checkpoint`` (the one loaded)."""
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


def _statement_link(checkpoint: Committed) -> dict[str, Any] | None:
    """``{"provenance": {"file", "sha256"}}`` for ``checkpoint``'s statement, or None when it has none."""
    # Note: a save's CheckpointInfo carries the statement's hash; a checkpoint found on disk does not, so read it.
    digest: str | None = getattr(checkpoint, "provenance_sha256", None)
    if digest is None:
        try:
            found = read_statement(checkpoint.path)
        except IntegrityError:
            found = None
        digest = found[1] if found else None
    return {"provenance": {"file": STATEMENT_FILE, "sha256": digest}} if digest else None


def _held(checkpoint: Committed) -> dict[str, int] | None:
    """``{"files", "bytes"}`` of a save's ``CheckpointInfo`` (the data files, ``.metadata`` and the statement), or
    None for a checkpoint that does not carry them."""
    files, size = getattr(checkpoint, "files", None), getattr(checkpoint, "total_bytes", None)
    if isinstance(files, int) and isinstance(size, int) and not isinstance(files, bool):
        return {"files": files, "bytes": size}
    return None
