"""Retention: keep the newest N regular checkpoints, and leave a tombstone in the ledger for each one deleted.

Note: the order of a deletion, so that a crash anywhere leaves a chain that verifies.

1. Only after a newer checkpoint has committed and been recorded, and every rank has agreed on
   that (the manager calls :func:`apply_retention` on rank 0 after the save returned), are older
   ones considered. A failure here is a warning: the chain and the next save's parent are not
   affected.
2. A **tombstone row** is appended first: the deleted checkpoint's step, directory and manifest
   hash, why it was deleted, what it held (file count, bytes), the SHA-256 of its provenance
   statement and a copy of the statement itself, and the SHA-256 of its signature file if it had
   one. From then on the ledger says the files are meant to be gone.
3. The directory is renamed to a hidden ``.step-N.deleting-<hex>`` (atomic; nothing resumes from
   it), the parent fsynced, then removed; its signature file ``step-N.sig`` beside it goes too.

A crash after 2 leaves the checkpoint on disk with a tombstone: the ledger check notes it, and the
next retention pass finishes the deletion without a second row. A crash after the rename leaves a
hidden directory the next manager removes.

In an object store (``s3://...``) there is no rename, so step 3 is: delete the checkpoint's
``manifest.json`` -- its commit record: from that request on it is not listed, loaded or resumed
-- then its signature object, then every other object under its prefix. A crash before the
manifest's deletion leaves a tombstoned checkpoint still committed (the next pass deletes it, no
second row); a crash after it leaves a prefix without a manifest that the tombstone names: the
next pass finds it in the listing and removes it (:func:`_finish_deletions`), again without
a row. Such a prefix is never mistaken for a checkpoint in between, and a save of the same step
in the meantime finds its prefix taken and says so. The chain itself never changes: the commit row stays,
the tombstone follows it, and ``shardline lineage`` accepts a recorded checkpoint that is gone
only when a tombstone (or a quarantine move) accounts for it.

What is counted: regular checkpoints (``step-N``) in the manager's directory that the ledger
records, ordered by the ledger (never by a clock), with the live branch -- the checkpoint just
committed and its ancestors, following parent manifest hashes -- counted as newer than every
other branch. So after an explicit resume from step-300 while step-400 and step-500 exist, the
branch point step-300 is one of the newest of the live branch and is kept, while the abandoned
step-400/500 are the oldest and go first (each with its tombstone). Tagged ones
(``step-N-on_exception``) are kept: they are records of something that went wrong, not
periodic saves. The checkpoint just committed is never deleted. With a best-k policy
(:mod:`.best`), the k regular checkpoints with the best recorded value of the monitored metric,
and always the newest regular one, are kept too: the union with ``keep_last_n``.

Note: what a pass reads. The checkpoints in the directory come from their commit rows once each one's manifest
bytes hash to what its row records (:mod:`.recorded_heads`), and a tombstone's file count and bytes from the
deleted one's commit row: no manifest's file list is parsed (17 MB each at 16,384 ranks). Checkpoints no row
records that way, and rows written before ``detail.held`` existed, are read whole as before. Of the ledger, only the
rows about the checkpoints in the directory and the newest one's ancestors are read, by the ledger's indexes
(:mod:`.directory_rows`): a pass costs the same after 100 saves as after 100,000 rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.integrity.manifest import manifest_files, read_manifest
from shardline.checkpoint.provenance.best import BestPolicy, best_kept
from shardline.checkpoint.provenance.directory import CommittedCheckpoint
from shardline.checkpoint.provenance.directory_rows import live_branch_placing, read_directory
from shardline.checkpoint.provenance.ledger import TOMBSTONE, Ledger, LedgerRow
from shardline.checkpoint.provenance.ledger_query import has_event
from shardline.checkpoint.provenance.recorded_heads import commit_rows, held_recorded
from shardline.checkpoint.provenance.records import record_tombstone
from shardline.checkpoint.provenance.statement import STATEMENT_FILE, read_statement
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.errors import CheckpointError, ConfigurationError, IntegrityError

__all__ = [
    "RetentionPolicy",
    "apply_retention",
    "record_deletions",
    "retire",
    "signature_path_for",
    "tombstone_detail",
    "tombstones",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which checkpoints to keep: the newest ``keep_last_n`` regular ones, and the ``best`` k by a metric
    (:mod:`.best`); both 0 keeps every checkpoint. Together they keep the union, plus the newest regular one."""

    keep_last_n: int = 0
    best: BestPolicy = field(default_factory=BestPolicy)

    def __post_init__(self) -> None:
        n = self.keep_last_n
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigurationError(
                f"checkpoint.keep_last_n must be a non-negative integer (0 keeps every checkpoint), got {n!r}"
            )

    @property
    def active(self) -> bool:
        """Whether this policy ever deletes anything."""
        return self.keep_last_n > 0 or self.best.active

    def describe(self) -> str:
        """``checkpoint.keep_last_n=2``, with the best-k policy when there is one."""
        text = f"checkpoint.keep_last_n={self.keep_last_n}"
        return f"{text}, {self.best.describe()}" if self.best.active else text


def signature_path_for(checkpoint: Location) -> Location:
    """Where ``shardline sign`` puts a checkpoint's signature by default: ``step-N.sig`` beside the directory."""
    return checkpoint.with_name(checkpoint.name + ".sig")


def tombstones(rows: list[LedgerRow]) -> dict[str, LedgerRow]:
    """``checkpoint directory (as the ledger names it) -> its newest tombstone row``."""
    out: dict[str, LedgerRow] = {}
    for row in rows:
        if row.event == TOMBSTONE:
            out[row.checkpoint] = row
    return out


def _what_it_held(ckpt: CommittedCheckpoint, row: LedgerRow | None = None) -> dict[str, Any]:
    """The tombstone's ``held``: file count and bytes, the statement, the signature's hash.

    The counts come from ``row`` (its commit row, matched by name and manifest hash) when it records them and the
    statement reads: the numbers the save counted, statement included (:mod:`.recorded_heads`); else from the
    manifest's file list.
    """
    try:
        found = read_statement(ckpt.path)
        problem = None
    except IntegrityError as e:
        found, problem = None, str(e)
    counted = held_recorded(row) if found is not None else None
    if counted is not None:
        held: dict[str, Any] = dict(counted)
    else:
        manifest, _ = read_manifest(ckpt.path)
        files = manifest_files(manifest)
        held = {"files": len(files), "bytes": sum(int(f["bytes"]) for f in files)}
        if found is not None and all(f["path"] != STATEMENT_FILE for f in files):  # naming the manifest: not listed
            held["files"] += 1
            held["bytes"] += len(canonical_json(found[0]))
    if problem is not None:
        held["provenance_problem"] = problem
    if found is not None:
        held["provenance_sha256"] = found[1]
        held["provenance"] = found[0]
    sig = signature_path_for(ckpt.path)
    if sig.is_file():
        held["signature"] = sig.name
        held["signature_sha256"] = hashlib.sha256(sig.read_bytes()).hexdigest()
    return held


def _remove(path: Location) -> None:
    """Delete a checkpoint and its signature through its store (see :meth:`.CheckpointStore.remove`)."""
    store_for(path).remove(path, companions=[signature_path_for(path)])


def _finish_deletions(
    directory: Location, committed: list[CommittedCheckpoint], ledger: Ledger, rel: Callable[[Location], str]
) -> None:
    """Remove what a tombstone names and a crash left half deleted under its own name, without its commit record
    (an object store, where the manifest goes first; one listing of ``directory``). Nothing on disk, where a
    deletion renames first and the manager removes the hidden name on open."""
    if not ledger.path.is_file() or not ledger.read(lambda conn, path: has_event(conn, path, TOMBSTONE)):
        return
    live = {c.path for c in committed}
    store = store_for(directory)
    for child in store.half_removed(directory):
        if child in live:
            continue
        name = rel(child)
        rows = ledger.rows_about(checkpoints=[name])
        tomb = tombstones(rows).get(name)
        if tomb is None or any(r.seq > tomb.seq and r.is_commit and r.checkpoint == name for r in rows):
            continue  # not tombstoned, or saved again since (an uncommitted save of its own, not a leftover)
        log.info("retention: finishing the deletion of %s (tombstone row %d), interrupted by a crash", child, tomb.seq)
        _remove(child)


def apply_retention(
    *,
    directory: Location,
    ledger: Ledger,
    policy: RetentionPolicy,
    just_committed: Location,
    rel: Callable[[Location], str],
) -> list[LedgerRow]:
    """Rank 0, after ``just_committed`` committed and was recorded: delete what ``policy`` no longer keeps.

    ``rel`` turns a checkpoint path into the name the ledger uses for it. Returns the tombstone
    rows appended (a deletion a crash interrupted is finished without a new row).
    """
    if not policy.active:
        return []
    found = read_directory(directory, ledger=ledger, rel=rel)  # only their rows, manifests not parsed: see the note
    committed, rows = found.committed, found.rows
    _finish_deletions(directory, committed, ledger, rel)
    newest_ckpt = next((c for c in committed if c.path == just_committed), None)
    if newest_ckpt is None:
        return []  # not on disk as a committed checkpoint: nothing to measure the branch from
    recorded = {r.manifest_sha256 for r in rows if r.is_commit}
    buried = tombstones(rows)
    commits = commit_rows(rows)
    branch = live_branch_placing(ledger, newest_ckpt, committed)  # as lineage.live_branch, as far as needed
    regular = [c for c in committed if c.tag is None]
    regular = [c for c in regular if c.manifest_hash not in branch] + [c for c in regular if c.manifest_hash in branch]
    newest_n = regular[-policy.keep_last_n :] if policy.keep_last_n else regular[-1:]  # the newest, for a resume
    keep = {c.path for c in newest_n} | set(best_kept(regular, rows, policy.best)) | {just_committed}  # a union
    appended: list[LedgerRow] = []
    newest = rel(just_committed)
    for ckpt in regular:
        if ckpt.path in keep or ckpt.manifest_hash not in recorded:
            continue  # never delete what the chain does not record
        name = rel(ckpt.path)
        earlier = buried.get(name)
        if earlier is None or earlier.manifest_sha256 != ckpt.manifest_hash:
            appended.append(
                record_tombstone(
                    ledger,
                    of=ckpt,
                    checkpoint=name,
                    reason=f"retention: {policy.describe()} after {newest} committed",
                    keep_last_n=policy.keep_last_n,
                    keep_best_k=policy.best.keep_best_k or None,
                    newer=newest,
                    held=_what_it_held(ckpt, commits.get((name, ckpt.manifest_hash))),
                )
            )
            crash_point("retention.tombstone")
        try:
            _remove(ckpt.path)
        except OSError as e:  # recorded already; the next pass retries, training goes on
            log.warning("retention: could not delete %s (%s); the next save retries", ckpt.path, e)
            continue
        log.info("retention: deleted %s (%s); a tombstone row records it", ckpt.path.name, policy.describe())
    return appended


def retire(path: str | os.PathLike[str] | Location, *, ledger: Ledger, reason: str) -> LedgerRow | None:
    """Delete one committed checkpoint on purpose, the way retention does: its tombstone row first (what it
    held, its statement), then the rename to a hidden name, its signature, the removal.

    For callers that choose what to delete themselves (Lightning's ``ModelCheckpoint`` top-k pruning).
    A checkpoint the ledger does not record is not deleted (the chain would lose it without a trace).
    Returns the tombstone row (None when a crash had already written it and only the deletion is finished).

    Raises:
        CheckpointError: ``path`` is not a committed checkpoint the ledger records (named, with the fix).
    """
    path = locate(path, storage_options=ledger.storage_options).absolute()
    try:
        manifest, digest = read_manifest(path)
    except CheckpointError as e:
        raise CheckpointError(f"cannot delete {path} as a checkpoint: {e}") from e
    name = ledger.name_of(path)
    rows = ledger.rows_about(checkpoints=[name], manifests=[digest])  # its commit rows and tombstones
    if digest not in {r.manifest_sha256 for r in rows if r.is_commit}:
        raise CheckpointError(
            f"refusing to delete {path}: the ledger {ledger.path} does not record its manifest {digest[:12]}, so "
            "its deletion could not be recorded against its commit. Record it first (open a CheckpointManager on "
            "its directory), or delete it by hand and run `shardline lineage --record-deletions`."
        )
    ckpt = CommittedCheckpoint(
        path=path,
        step=int(manifest.get("step", 0)),
        tag=manifest.get("tag"),
        manifest_hash=digest,
        created_unix_ns=int(manifest.get("created_unix_ns", 0)),
        parent_manifest_hash=manifest.get("parent_manifest_sha256"),
        world_size=int(manifest.get("world_size", 0)),
    )
    earlier = tombstones(rows).get(name)
    row = None
    if earlier is None or earlier.manifest_sha256 != digest:
        held = _what_it_held(ckpt, commit_rows(rows).get((name, digest)))  # its counts from its row, not reparsed
        row = record_tombstone(ledger, of=ckpt, checkpoint=name, reason=reason, held=held)
        crash_point("retention.tombstone")
    _remove(ckpt.path)
    return row


_AFTER_THE_FACT = (
    "gone from disk, deleted outside shardline; recorded after the fact by `shardline lineage --record-deletions`"
)


def record_deletions(ledger: Ledger, *, reason: str = _AFTER_THE_FACT) -> list[LedgerRow]:
    """Append a tombstone for every recorded checkpoint that is gone from disk without one (deleted by hand).

    Checkpoints moved aside by a quarantine, or already tombstoned, are left alone. The rows say
    the deletion was recorded after the fact (``reason``: by default, by ``shardline lineage
    --record-deletions``), so nothing about the files can be vouched for.
    """
    rows = ledger.rows()
    # Every tombstone, not only the newest per name: a name can be reused (a Trainer that went back to an
    # earlier checkpoint saves the same checkpoint-N again), and each commit under it has its own.
    buried = {(r.checkpoint, r.manifest_sha256): r.seq for r in rows if r.event == TOMBSTONE}
    moved = {
        str(tombstone_detail(r).get("checkpoint")) for r in rows if r.event == "quarantine"
    }  # quarantine details name the original directory
    appended: list[LedgerRow] = []
    for row in rows:
        if not row.is_commit or not row.checkpoint or row.checkpoint in moved:
            continue
        if buried.get((row.checkpoint, row.manifest_sha256), 0) > row.seq:
            continue
        # Looked for where the row says (a URL in its store, a path beside the ledger), as its store counts
        # presence: an object store by the commit record, since it may keep listing a prefix whose objects went.
        where = ledger.locate(row.checkpoint)
        if store_for(where).still_there(where):
            continue
        appended.append(record_tombstone(ledger, of=row, checkpoint=row.checkpoint, reason=reason, commit_row=row.seq))
    return appended


def tombstone_detail(row: LedgerRow) -> dict[str, Any]:
    """The parsed ``detail`` of a tombstone row (empty when it cannot be parsed)."""
    try:
        detail = json.loads(row.detail or "{}")
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}
