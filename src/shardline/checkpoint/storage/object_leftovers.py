"""What saves into an object store leave when they die before their manifest, and clearing it when a manager opens.

Note: the object-store twin of removing ``.step-N.tmp-*`` on open. A save into a bucket writes
under its final prefix (no rename), so a save whose rank 0 died before the manifest -- a
preemption deadline, SIGKILL, a lost node -- leaves ``step-N/`` with some objects, perhaps
``.metadata``, multipart uploads in progress, and its claim ``step-N.shardline-claim`` beside it.
Nothing lists, loads or resumes such a prefix, but it blocks every later save of step N (a save
never writes into a prefix that is not empty). So on open, rank 0 clears each such prefix whose
claim no live save holds (:func:`.claims.judge`): the multipart uploads under it are aborted, its
objects deleted, then its claim -- last, so a crash while clearing leaves a claimed prefix the next
open clears again -- and one warning line says what was cleared and why, as the local protocol
logs each temporary directory it removes.

What is never cleared: a prefix with a ``manifest.json`` (committed, or damaged: quarantine's
business), one the ledger records as committed (missing its manifest is evidence for ``shardline
lineage``, not garbage), and one whose claim may be live. The order of the reads matters: claims
are read from one listing of the directory taken first, manifests after it. A live save deletes
its claim only after its manifest is up, so a prefix that had no claim at the first read and has
no manifest at the second has no save in flight; a claim that vanished between the two reads was
released by a save that committed since, and its prefix is left for the next open. Cost: one LIST
of the directory on every open, plus one LIST per prefix the ledger does not record as committed
(none, in a healthy directory).
"""

from __future__ import annotations

import logging

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.storage.claims import CLAIM_SUFFIX, LEGACY_CLAIM, judge, read_claim
from shardline.checkpoint.storage.objects import ObjectPath
from shardline.checkpoint.storage.protocol import COMMIT_RECORD, Cleared, is_checkpoint_name

__all__ = ["clear_store_leftovers"]

log = logging.getLogger(__name__)


def clear_store_leftovers(directory: ObjectPath, *, recorded: set[str], run: str | None) -> list[Cleared]:
    """Rank 0, on open: clear the prefixes of saves that died before their manifest (see the module note).

    ``recorded`` holds the URLs of the checkpoints the ledger records as committed; ``run`` is this run as its
    claims name it. Returns what was cleared.
    """
    listing = directory.snapshot()  # the first read: every claim, every prefix
    names = {child.name for child in listing.iterdir()}
    claimed = {name[: -len(CLAIM_SUFFIX)] for name in names if name.endswith(CLAIM_SUFFIX)}
    claimed = {name for name in claimed if is_checkpoint_name(name)}
    prefixes = {name for name in names if is_checkpoint_name(name) and (listing / name).is_dir()}
    cleared: list[Cleared] = []
    for name in sorted(prefixes | claimed):
        try:
            done = _clear(directory, name, claimed=name in claimed, recorded=recorded, run=run)
        except Exception as e:  # the store failing: opening goes on; a save of that step says what blocks it
            log.warning("could not clear %s (%s: %s); the next open retries", directory / name, type(e).__name__, e)
            continue
        if done is not None:
            cleared.append(done)
    return cleared


def _clear(directory: ObjectPath, name: str, *, claimed: bool, recorded: set[str], run: str | None) -> Cleared | None:
    """Clear the prefix ``name`` if a save that died left it (see the module note); what was cleared, if anything.

    ``claimed``: the first read listed its claim beside it.
    """
    prefix = directory / name
    claim = directory / (name + CLAIM_SUFFIX)
    if str(prefix) in recorded:
        if claimed and (prefix / COMMIT_RECORD).is_file():
            log.info("removing %s, the claim of a save that committed %s", claim, prefix)
            claim.unlink()
        return None
    inside = set(prefix.snapshot(deep=True).files())  # the second read: every object, in shards/GGGG/ too
    if COMMIT_RECORD in inside:
        if claimed:
            log.info("removing %s, the claim of a save that committed %s", claim, prefix)
            claim.unlink()
        return None
    holder = claim if claimed else (prefix / LEGACY_CLAIM if LEGACY_CLAIM in inside else None)
    reason = "no claim holds it"
    if holder is not None:
        found, modified = read_claim(holder)
        if found is None and modified is None:
            return None  # released since the first read: a save committed there meanwhile
        why = judge(found, modified, run=run)
        if why is None:
            log.info("leaving %s, which has no manifest yet: a live save may hold its claim %s", prefix, holder)
            return None
        reason = why
    uploads = prefix.abort_uploads()
    prefix.remove_tree()
    crash_point("recovery.store_cleared")
    if claimed:
        claim.unlink()
        crash_point("recovery.store_claim_removed")
    log.warning(
        "cleared %s, left by a checkpoint save that did not commit (no manifest.json): %d object(s) deleted, "
        "%d multipart upload(s) aborted%s; %s",
        prefix,
        len(inside),
        uploads,
        f", its claim {claim.name} removed" if claimed else "",
        reason,
    )
    return Cleared(prefix=str(prefix), objects=len(inside), uploads=uploads, reason=reason)
