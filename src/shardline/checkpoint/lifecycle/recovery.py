"""What a :class:`~.manager.CheckpointManager` does when it opens a directory (rank 0): recover from crashes.

In order: the store removes what crashed saves left that needs no ledger to judge (on disk,
hidden temporary directories no live save holds: :meth:`.CheckpointStore.open_directory`); the
ledger's chain is checked; quarantines a crash interrupted are finished (:mod:`.quarantine`) and
the store clears the targets of saves that died before their commit and that no live save holds
(:meth:`.CheckpointStore.clear_leftovers`: in a bucket, prefixes without a manifest); the
committed checkpoints are compared with the ledger -- a checkpoint committed just before a
crash, and not yet recorded, gets its row (``recovered``); anything else unrecorded refuses the
directory -- and ``latest`` is repointed at the newest regular checkpoint.

Note: failing closed. A chain that does not verify is refused -- nothing is appended to it --
with the way to continue (restore the ledger, or ``shardline lineage --new-chain``).
"""

from __future__ import annotations

from collections.abc import Callable

from shardline.checkpoint.lifecycle.quarantine import finish_quarantines
from shardline.checkpoint.provenance.directory import CommittedCheckpoint
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow
from shardline.checkpoint.provenance.lineage import unrecorded
from shardline.checkpoint.provenance.records import record_commit
from shardline.checkpoint.provenance.retention import tombstone_detail
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import store_for
from shardline.errors import LineageError

__all__ = ["recorded_committed", "recover", "run_name"]


def run_name(ledger: Ledger, rows: list[LedgerRow]) -> str:
    """This run as an object-store claim names it: its ledger's path, and the ledger's first row once there is one
    (see ``storage/claims.py``, ``judge``)."""
    return str(ledger.path) + (f"#{rows[0].row_sha256}" if rows else "")


def recorded_committed(ledger: Ledger, rows: list[LedgerRow]) -> set[str]:
    """Checkpoints (as the ledger names them) whose newest row is their commit (not a tombstone or a move)."""
    newest: dict[str, bool] = {}
    for row in rows:
        if row.is_commit:
            newest[row.checkpoint] = True
        elif row.event == "tombstone":
            newest[row.checkpoint] = False
        elif row.event == "quarantine":
            newest[str(tombstone_detail(row).get("checkpoint") or "")] = False
    return {name for name, committed in newest.items() if committed}


def recover(
    directory: Location, *, ledger: Ledger, committed: Callable[[], list[CommittedCheckpoint]]
) -> Location | None:
    """Rank 0, when a manager opens ``directory`` (see the module note); returns the newest committed checkpoint.

    ``committed`` lists the committed checkpoints, oldest first by the ledger.

    Raises:
        LineageError: the ledger's chain does not verify, or committed checkpoints are missing from it.
    """
    store = store_for(directory)
    store.open_directory(directory)
    problems: list[str] = []
    if ledger.path.is_file():
        problems += ledger.verify(check_checkpoints=False).problems
    elif ledger.head_path.exists():
        problems.append(f"the ledger is gone but its head record {ledger.head_path.name} is still there")
    if not problems:
        rows = ledger.rows() if ledger.path.is_file() else []
        finish_quarantines(directory, ledger=ledger, rows=rows)
        store.clear_leftovers(directory, committed=recorded_committed(ledger, rows), run=run_name(ledger, rows))
    missing, recoverable = unrecorded(ledger, [directory])
    problems += [
        f"{c.path.name} (step {c.step}) is committed on disk but missing from the ledger"
        for c in missing
        if c is not recoverable
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise LineageError(
            f"the lineage ledger {ledger.path} does not verify: {problems[0]}{more}; refusing to append to "
            f"a broken chain. Restore the ledger from a backup, or run `shardline lineage {ledger.path} "
            "--new-chain` to keep it aside and start a new chain whose first row records the break."
        )
    if recoverable is not None:
        record_commit(ledger, recoverable, recovered=True)
    found = committed()
    regular = [c for c in found if c.tag is None]
    store.repoint_latest(directory, newest=lambda: regular[-1].path if regular else None)
    return found[-1].path if found else None
