"""The ledger against the disk: every committed checkpoint on disk must be in the chain.

:meth:`Ledger.verify <shardline.checkpoint.provenance.ledger.Ledger.verify>` checks the chain itself (row
hashes, links, the head record) and that each recorded checkpoint still on disk has the
manifest hash its row records. :func:`audit` adds the other direction: a committed checkpoint
on disk that the ledger does not record. Exactly one such checkpoint is expected after a crash
between a save's commit and its ledger row -- the newest one, descending from a recorded
checkpoint (or from none) -- and is only noted: the next manager records it as ``recovered``.
Anything else means rows are missing, and the chain does not verify.

The same holds for a run whose checkpoints are in an object store (its ledger stays local and
names them by URL): :func:`checkpoint_directories` adds the bucket prefix of every row naming a
URL, and :func:`audit` lists those prefixes for committed checkpoints (a prefix holding a
``manifest.json``) exactly as it lists a local directory.

Note: what "newest" means. Checkpoints are ordered by the ledger, never by a clock: a
checkpoint's place is the sequence number of its (newest) commit row, so a node whose clock
is behind cannot make step-300 sort before step-200. A committed checkpoint the ledger does
not record yet (the interrupted publish above) comes after every recorded one; several
(only while a broken ledger is being replaced) are ordered parents first, then by step
(:func:`order`).
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from shardline.checkpoint.provenance.directory import CHECKPOINTS_DIR, CommittedCheckpoint, scan
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger, LedgerRow, LineageReport, row_hash
from shardline.checkpoint.provenance.ledger_query import commit_directories
from shardline.checkpoint.provenance.recorded_heads import from_ledger
from shardline.checkpoint.provenance.records import commit_row
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import check_reachable, locate, sorted_locations, store_for
from shardline.errors import LineageError

__all__ = [
    "audit",
    "chain_order",
    "check_stores",
    "checkpoint_directories",
    "describe_event",
    "find_ledger",
    "live_branch",
    "note_row",
    "order",
    "place",
    "start_new_chain",
    "unrecorded",
]


def find_ledger(run_dir: str | os.PathLike[str]) -> Path:
    """The ledger for ``run_dir``: the path itself if a file, else ``lineage.sqlite`` in it or in ``checkpoints/``.

    Raises:
        LineageError: none of those exists.
    """
    root = Path(run_dir)
    if root.is_file():
        return root
    candidates = [root / LEDGER_NAME, root / CHECKPOINTS_DIR / LEDGER_NAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise LineageError(f"no lineage ledger found: looked for {', '.join(str(c) for c in candidates)}")


def checkpoint_directories(ledger: Ledger, *, also: Iterable[str | os.PathLike[str] | Location] = ()) -> list[Location]:
    """Where a ledger's checkpoints live: the directories its rows name, the ledger's own, ``checkpoints/``, and
    ``also`` (e.g. the run's recorded ``checkpoint.dir``); for rows naming a URL, the bucket prefix holding them.

    Local directories that do not exist are left out; bucket prefixes are kept (listing one that is
    empty finds nothing, and :func:`audit` checks that its bucket can be reached).
    """
    base = ledger.path.parent
    found: set[Location] = {base, base / CHECKPOINTS_DIR}
    if ledger.path.is_file():
        for name in ledger.read(commit_directories):  # one commit row's name per directory, not every row
            found.add(ledger.locate(name).parent)
    for where in also:
        found.add(locate(where, storage_options=ledger.storage_options, relative_to=base))
    return sorted_locations(d for d in found if store_for(d).may_hold_checkpoints(d))


def check_stores(directories: Iterable[Location]) -> None:
    """Check that each bucket among ``directories`` can be reached and listed (one request per bucket).

    Raises:
        StorageAccessError: naming the endpoint and bucket, and how to fix it.
    """
    check_reachable(directories)


def place(checkpoint: CommittedCheckpoint) -> str:
    """How a message names a checkpoint: its directory name on disk, its whole URL in an object store."""
    return store_for(checkpoint.path).short_name(checkpoint.path)


def chain_order(committed: Iterable[CommittedCheckpoint]) -> list[CommittedCheckpoint]:
    """Parents before their children (by ``parent_manifest_hash``), otherwise by step, then name."""
    items = list(committed)
    by_hash = {c.manifest_hash: i for i, c in enumerate(items)}
    waiting = [0] * len(items)
    children: dict[int, list[int]] = {}
    for i, c in enumerate(items):
        parent = by_hash.get(c.parent_manifest_hash or "")
        if parent is not None and parent != i:
            waiting[i] = 1
            children.setdefault(parent, []).append(i)
    ready = [(c.step, c.path.name, i) for i, c in enumerate(items) if not waiting[i]]
    heapq.heapify(ready)
    out: list[CommittedCheckpoint] = []
    while ready:
        _, _, i = heapq.heappop(ready)
        out.append(items[i])
        for child in children.get(i, []):
            heapq.heappush(ready, (items[child].step, items[child].path.name, child))
    done = {id(c) for c in out}
    return out + sorted((c for c in items if id(c) not in done), key=lambda c: (c.step, c.path.name))  # a cycle


def order(committed: Iterable[CommittedCheckpoint], rows: Iterable[LedgerRow]) -> list[CommittedCheckpoint]:
    """``committed`` oldest first by the ledger (see the module note): by the sequence number of each one's
    newest commit row; the ones no row records after them, in :func:`chain_order`."""
    seq = {r.manifest_sha256: r.seq for r in rows if r.is_commit}
    items = list(committed)
    recorded = sorted((c for c in items if c.manifest_hash in seq), key=lambda c: (seq[c.manifest_hash], c.step))
    return recorded + chain_order(c for c in items if c.manifest_hash not in seq)


def live_branch(
    newest: CommittedCheckpoint, committed: Iterable[CommittedCheckpoint], rows: Iterable[LedgerRow]
) -> set[str]:
    """Manifest hashes of ``newest`` and its ancestors (following parent hashes through the checkpoints on disk
    and the ledger's commit rows): the branch training is on."""
    parents = {r.manifest_sha256: r.parent_manifest_sha256 for r in rows if r.is_commit}
    parents.update({c.manifest_hash: c.parent_manifest_hash for c in committed})
    parents[newest.manifest_hash] = newest.parent_manifest_hash
    branch: set[str] = set()
    current: str | None = newest.manifest_hash
    while current and current not in branch:
        branch.add(current)
        current = parents.get(current)
    return branch


def unrecorded(
    ledger: Ledger, directories: Iterable[Location], *, rows: list[LedgerRow] | None = None
) -> tuple[list[CommittedCheckpoint], CommittedCheckpoint | None]:
    """Committed checkpoints on disk the ledger does not record (oldest first, see :func:`order`), and which one
    of them (if any) is a legitimate interrupted publish.

    That one is the only unrecorded checkpoint, nothing on disk or in the ledger descends from it,
    its parent is recorded, absent (a first save) or foreign (neither recorded nor on disk here: a
    run that resumed from another run directory, such as a fine-tune), and the ledger reaches the
    row its head record names. ``rows``: the ledger's rows, when the caller has read them already.
    """
    if rows is None:
        rows = ledger.rows() if ledger.path.is_file() else []
    known = from_ledger(rows, ledger.name_of)  # recorded ones from their rows, manifests not parsed
    committed: list[CommittedCheckpoint] = []
    for directory in directories:
        committed += scan(directory, known=known)[0]
    recorded = {r.manifest_sha256 for r in rows if r.is_commit}
    missing = [c for c in order(committed, rows) if c.manifest_hash not in recorded]
    if len(missing) != 1 or ledger.head_problems(rows):  # a ledger short of its head lost rows: nothing interrupted
        return missing, None
    candidate = missing[0]
    on_disk = {c.manifest_hash for c in committed}
    parents = {c.parent_manifest_hash for c in committed} | {r.parent_manifest_sha256 for r in rows if r.is_commit}
    parent = candidate.parent_manifest_hash
    if candidate.manifest_hash not in parents and (parent is None or parent in recorded or parent not in on_disk):
        return missing, candidate
    return missing, None


def audit(
    ledger: Ledger, *, directories: Iterable[Location] | None = None, check_checkpoints: bool = True
) -> LineageReport:
    """:meth:`Ledger.verify` plus the checkpoint directories (``directories``, default
    :func:`checkpoint_directories`; bucket prefixes too): problems name every committed checkpoint the chain lacks.

    Raises:
        LineageError: the ledger file is missing or unreadable.
        StorageAccessError: a bucket the ledger names cannot be reached or listed (checked first, so
            an unreachable store is one error, not a problem per row).
    """
    dirs = list(directories) if directories is not None else None
    if check_checkpoints:
        dirs = dirs if dirs is not None else checkpoint_directories(ledger)
        check_stores(dirs)
    report = ledger.verify(check_checkpoints=check_checkpoints)
    if not check_checkpoints or dirs is None:
        return report
    missing, recoverable = unrecorded(ledger, dirs, rows=list(report.rows))  # the rows verify read
    problems, notes = list(report.problems), list(report.notes)
    head = next((r for r in reversed(report.rows) if r.is_commit), None)
    where = f"row {head.seq} (step {head.step}, {head.checkpoint})" if head else "no checkpoint"
    for c in missing:
        if c is recoverable:
            notes.append(
                f"{place(c)} (step {c.step}, manifest {c.manifest_hash[:12]}) is committed but not yet in the "
                "ledger: "
                "its save was interrupted after the commit; the next training run on this directory records it "
                "(marked recovered)"
            )
        else:
            store = store_for(c.path).place
            problems.append(
                f"{place(c)} (step {c.step}, manifest {c.manifest_hash[:12]}) is committed {store} but missing from "
                f"the ledger, whose newest checkpoint is {where}"
            )
    return replace(report, problems=tuple(problems), notes=tuple(notes))


def start_new_chain(ledger: Ledger, *, problems: list[str]) -> tuple[Path, list[LedgerRow]]:
    """Keep a ledger that does not verify aside and start a new chain that records the break.

    The new ledger's first row is a ``chain_break`` naming the old file (kept, with its SHA-256)
    and ``problems``; then every committed checkpoint on disk (or in a bucket the ledger names, by URL) is recorded
    again, marked
    ``recovered``, in the old ledger's order where its rows are readable (:func:`order`), so the new
    chain covers what is there and training can append to it. The switch to the new ledger is one
    rename (:meth:`Ledger.start_new_chain`). Returns (where the old ledger went, the new rows).
    """
    dirs = checkpoint_directories(ledger)
    try:
        old_rows = ledger.rows() if ledger.path.is_file() else []
    except LineageError:
        old_rows = []
    # Note: a checkpoint is taken from its old commit row (manifests not parsed, .recorded_heads) only when that
    # row is as written -- its content matches its own row hash -- and its manifest's bytes hash to what the row
    # records; an edited row, or none, and the manifest is read whole.
    intact = [r for r in old_rows if r.is_commit and row_hash(r.to_json()) == r.row_sha256]
    known = from_ledger(intact, ledger.name_of)
    committed: list[CommittedCheckpoint] = []
    for directory in dirs:
        committed += scan(directory, known=known)[0]
    rows = [commit_row(ledger, c, recovered=True) for c in order(committed, old_rows)]
    return ledger.start_new_chain(reason="the ledger did not verify", problems=problems, rows=rows)


def note_row(note: str) -> int:
    """The sequence number a note of :meth:`.Ledger.verify` is about (it starts ``row N (step ...)``), else 0."""
    head = note.split(" ", 2)
    return int(head[1]) if len(head) > 2 and head[0] == "row" and head[1].isdigit() else 0


def describe_event(row: LedgerRow) -> str:
    """An event row of the ledger (quarantine, resume, tombstone, chain break, restart) in plain words."""
    try:
        detail = json.loads(row.detail) if row.detail else {}
    except ValueError:
        detail = {}
    if not isinstance(detail, dict):
        detail = {}
    what = detail.get("checkpoint")
    if row.event == "quarantine":
        return f"{what} failed verification, moved to {detail.get('moved_to')}"
    if row.event == "resume":
        return f"resumed from {what} with verify={detail.get('verify')!r} (not every byte hashed)"
    if row.event == "tombstone":
        reason = detail.get("reason", "no reason recorded")
        if detail.get("moved_to"):
            return (
                f"{what} retired on purpose and moved to {detail['moved_to']} ({reason}); its record stays in the chain"
            )
        return f"{what} deleted on purpose ({reason}); its record stays in the chain"
    if row.event == "restart":
        elastic = detail.get("elastic_restart")
        return (
            f"world size {detail.get('world_size_before', '?')} -> {detail.get('world_size_after', row.world_size)} "
            f"({detail.get('cause', 'cause unknown')}), resumed from {what} at step {row.step}"
            + (f", torchrun restart {elastic}" if elastic is not None else "")
        )
    if row.event == "chain_break":
        return (
            f"new chain; the previous ledger ({detail.get('previous_ledger', 'missing')}) did not verify: "
            + "; ".join(detail.get("problems", []))
        )
    return row.detail or ""
