"""The committed checkpoints of a directory with the ledger rows about them, and only those rows.

Retention (at every save) and resume selection need, of a ledger that grows by a row or two per
save, the rows of the few checkpoints in the directory: the rows naming each one (its commit rows,
its tombstones), the commit rows of each one's manifest hash (the ledger's order and the metrics a
best-k policy ranks by), and for retention the parents of the newest one's ancestors (the live
branch). :func:`read_directory` and :func:`live_branch_placing` fetch those by the ledger's indexes
(:mod:`.ledger_query`); the functions that use the rows (:func:`.lineage.order`,
:func:`.recorded_heads.from_ledger`, :func:`.best.best_kept`, ``retention.tombstones``) take any rows and
answer the same for these checkpoints as over the whole ledger.

Note: the branch stops early. The live branch follows parent hashes from the newest checkpoint; only
whether each checkpoint in the directory is on it matters, so the walk stops once all of them are
(after as many steps as there are kept checkpoints, with no query when each one's parent is in the
directory). A directory holding a checkpoint off the live branch (an abandoned branch a best-k policy
keeps, a tagged one saved before a resume from an older checkpoint) walks to the chain's first
checkpoint: one indexed lookup per ancestor on one connection (microseconds each), which reads no row
but the parent hash.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from shardline.checkpoint.provenance.directory import CommittedCheckpoint, DamagedCheckpoint, scan
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow
from shardline.checkpoint.provenance.ledger_query import parent_lookup
from shardline.checkpoint.provenance.lineage import order
from shardline.checkpoint.provenance.recorded_heads import from_ledger
from shardline.checkpoint.storage.protocol import Location

__all__ = ["DirectoryRows", "live_branch_placing", "read_directory"]


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


def live_branch_placing(
    ledger: Ledger, newest: CommittedCheckpoint, committed: Iterable[CommittedCheckpoint]
) -> set[str]:
    """The manifest hashes of ``newest`` and its ancestors, as :func:`.lineage.live_branch` follows them (an on-disk
    checkpoint's own parent, else the newest commit row's), as far as needed to place every checkpoint of
    ``committed`` on or off the branch (see the module note): what retention asks of the branch."""
    on_disk = {c.manifest_hash: c.parent_manifest_hash for c in committed}
    on_disk[newest.manifest_hash] = newest.parent_manifest_hash
    unplaced = set(on_disk)

    def walk(conn: sqlite3.Connection | None, path: Path) -> set[str]:
        parent = parent_lookup(conn, path) if conn is not None else lambda manifest: None
        branch: set[str] = set()
        current: str | None = newest.manifest_hash
        while current and current not in branch and unplaced:
            branch.add(current)
            unplaced.discard(current)
            current = on_disk[current] if current in on_disk else parent(current)  # gone: one indexed lookup
        return branch

    return ledger.read(walk) if ledger.path.is_file() else walk(None, ledger.path)
