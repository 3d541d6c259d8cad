"""Moving a checkpoint that fails verification aside, and finishing a move a crash interrupted.

Note: a quarantine records before it moves. The ``quarantine`` row names where the checkpoint
will go (``step-N.damaged-<time>``, whose name is not a checkpoint name, so nothing resumes from
it and a later save of step N does not collide with it); then the store moves the checkpoint
(:meth:`.CheckpointStore.move_aside`: a rename on disk, copy-then-delete in a bucket), its
``step-N.sig`` follows it, and ``latest`` is repointed if it named it. A crash after the row
leaves a move the next manager on the directory finishes from the row (:func:`finish_quarantines`),
so the ledger never meets a moved checkpoint it does not account for, and a checkpoint is never
moved twice under two names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.provenance.directory import aside_path
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow
from shardline.checkpoint.provenance.records import record_quarantine
from shardline.checkpoint.provenance.retention import signature_path_for, tombstone_detail
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import store_for

__all__ = ["finish_quarantines", "move_aside"]

log = logging.getLogger(__name__)


def move_aside(
    path: Location,
    *,
    ledger: Ledger,
    directory: Location,
    reason: str,
    newest: Callable[[], Location | None],
) -> Location:
    """Rank 0: record, then move the checkpoint ``path`` aside with its signature, and repoint ``latest`` (to
    ``newest()``) if it named it; returns where it went (see the module note)."""
    store = store_for(path)
    target = aside_path(path)
    record_quarantine(ledger, checkpoint=path, moved_to=target, recorded=ledger.recorded_hash(path), reason=reason)
    crash_point("quarantine.recorded")
    store.move_aside(path, target)
    signature = signature_path_for(path)
    if signature.is_file():
        store.move_file(signature, signature_path_for(target))
        crash_point("quarantine.signature_moved")
    if store.repoint_latest(directory, newest=newest, only_from=path):
        crash_point("quarantine.latest")
    log.warning(
        "checkpoint %s failed verification and was moved aside to %s (recorded in the ledger): %s",
        store.short_name(path),
        target.name,
        reason,
    )
    return target


def finish_quarantines(directory: Location, *, ledger: Ledger, rows: list[LedgerRow]) -> None:
    """Rank 0, on open: finish the moves that ``quarantine`` rows record but a crash interrupted (the checkpoint,
    then its signature); one listing of ``directory``. A checkpoint saved again under that name since is left
    alone, and so are rows about other directories."""
    moves = [(row, tombstone_detail(row)) for row in rows if row.event == "quarantine"]
    if not moves:
        return
    store = store_for(directory)
    present = store.names(directory)
    here = ledger.name_of(directory)
    for row, detail in moves:
        source_text, target_text = str(detail.get("checkpoint") or ""), str(detail.get("moved_to") or "")
        if not source_text or not target_text:
            continue
        if any(r.seq > row.seq and r.is_commit and r.checkpoint == source_text for r in rows):
            continue  # the step was saved again after the quarantine: that name holds a new checkpoint
        source, target = ledger.locate(source_text), ledger.locate(target_text)
        if store_for(source) is not store or ledger.name_of(source.parent) != here:
            continue
        gone = source.name not in present or store.finish_move(source, target)
        signature, moved = signature_path_for(source), signature_path_for(target)
        if gone and signature.name in present and moved.name not in present:
            store.move_file(signature, moved)
