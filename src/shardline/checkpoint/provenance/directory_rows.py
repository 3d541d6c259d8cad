"""The committed checkpoints of a directory with the ledger rows about them, and only those rows.

Retention (at every save) and resume selection need, of a ledger that grows by a row or two per
save, the rows of the few checkpoints in the directory: the rows naming each one (its commit rows,
its tombstones), the commit rows of each one's manifest hash (the ledger's order and the metrics a
best-k policy ranks by), and for retention the commit rows of the newest one's ancestors (the live
branch). :func:`read_directory` and :func:`with_ancestors` fetch those by the ledger's indexes
(:mod:`.ledger_query`); the functions that use them (:func:`.lineage.order`, :func:`.lineage.live_branch`,
:func:`.recorded_heads.from_ledger`, :func:`.best.best_kept`, ``retention.tombstones``) take any rows and
answer the same for these checkpoints as over the whole ledger.

Note: the branch stops early. The live branch follows parent hashes from the newest checkpoint; only
whether each checkpoint in the directory is on it matters, so the walk stops once all of them are
(after as many steps as there are kept checkpoints, with no query when each one's parent is in the
directory). Only a directory holding an abandoned branch -- which is never on the live one -- walks
to the chain's first checkpoint, one indexed lookup per ancestor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardline.checkpoint.provenance.directory import CommittedCheckpoint, DamagedCheckpoint, scan
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow
from shardline.checkpoint.provenance.lineage import order
from shardline.checkpoint.provenance.recorded_heads import from_ledger
from shardline.checkpoint.storage.protocol import Location

__all__ = ["DirectoryRows", "read_directory", "with_ancestors"]


@dataclass(frozen=True)
class DirectoryRows:
    """A directory's committed checkpoints (oldest first by the ledger), its damaged ones, and the ledger rows about
    the committed ones (in append order)."""

    committed: list[CommittedCheckpoint]
    damaged: list[DamagedCheckpoint]
    rows: list[LedgerRow]


def read_directory(directory: Location, *, ledger: Ledger, rel: Callable[[Location], str]) -> DirectoryRows:
    """Scan ``directory`` (each recorded checkpoint taken from its commit row, :mod:`.recorded_heads`) and read
    the rows naming its committed checkpoints or recording their manifest hashes. ``rel`` turns a checkpoint path
    into the name the ledger uses for it."""

    def known(child: Location) -> CommittedCheckpoint | None:
        return from_ledger(ledger.rows_about(checkpoints=[rel(child)]), rel)(child)

    found, damaged = scan(directory, known=known)
    rows = ledger.rows_about(checkpoints=[rel(c.path) for c in found], manifests=[c.manifest_hash for c in found])
    return DirectoryRows(committed=order(found, rows), damaged=damaged, rows=rows)


def with_ancestors(
    ledger: Ledger, newest: CommittedCheckpoint, committed: Iterable[CommittedCheckpoint], rows: Iterable[LedgerRow]
) -> list[LedgerRow]:
    """``rows`` and the commit rows of ``newest``'s ancestors that :func:`.lineage.live_branch` follows to reach
    every checkpoint of ``committed`` on the branch (see the module note)."""
    have = {r.seq: r for r in rows}
    on_disk = {c.manifest_hash: c.parent_manifest_hash for c in committed}
    on_disk[newest.manifest_hash] = newest.parent_manifest_hash
    visited: set[str] = set()
    unseen = set(on_disk)
    current: str | None = newest.manifest_hash
    while current and current not in visited and unseen:
        visited.add(current)
        unseen.discard(current)
        if current in on_disk:
            current = on_disk[current]
            continue
        commits = [r for r in ledger.rows_about(manifests=[current]) if r.is_commit]  # the newest one's parent
        have.update((r.seq, r) for r in commits)
        current = commits[-1].parent_manifest_sha256 if commits else None
    return [have[seq] for seq in sorted(have)]
