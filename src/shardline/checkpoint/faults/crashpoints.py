"""Named crash points of the commit protocol: where a test may end the process to prove a crash there is safe.

Every place a save, the ledger, the ``latest`` pointer, retention, a quarantine or a new chain
changes a file, a directory or a row calls :func:`crash_point` with a name from
:data:`CRASH_POINTS` right after the change (or, for a ``before`` point, right before it).
Normally that is a comparison with None and nothing else.

A test arms one point in a child process (:func:`arm`), optionally at its k-th hit; when the
process reaches it, it ends at once with ``os._exit(CRASH_EXIT_CODE)`` -- no ``finally``
blocks, no flushing, like a node losing power. :func:`trace` instead records every point
reached, in order, so a test can enumerate what a scenario passes through and crash at each
in turn; ``tests/checkpoint/test_crash_points.py`` does, and fails when a point listed here
is reached by none of its scenarios. Nothing is read from the environment: a crash exists
only where a test armed one.

:data:`CRASH_POINTS` is the list; the docs (docs/checkpoint-protocol.md, "Crash points") say what
the next open sees and does after each.
"""

from __future__ import annotations

import os
import sys

__all__ = ["CRASH_EXIT_CODE", "CRASH_POINTS", "arm", "crash_point", "disarm", "trace", "traced"]

CRASH_EXIT_CODE = 86

CRASH_POINTS: tuple[str, ...] = (
    # save.py and the local store: the write and the commit
    "save.tmp_created",  # the hidden temp directory exists, empty
    "save.shards_written",  # DCP wrote .metadata and every .distcp into it
    "save.statement_written",  # provenance.intoto.json written and fsynced
    "save.manifest_written",  # manifest.json written and fsynced
    "save.hash_file_written",  # manifest.sha256 written and fsynced
    "save.sums_written",  # SHA256SUMS written and fsynced, directory fsynced
    "save.renamed",  # rename(tmp, step-N): the commit point, parent not yet fsynced
    "save.committed",  # the parent directory fsynced (object store: the manifest uploaded, the commit)
    # storage/object_store.py and claims.py, object store only: the claim, the uploads, its release
    "save.store_claimed",  # step-N.shardline-claim created (conditional PUT), nothing under the prefix yet
    "save.store_uploaded",  # one object (a shard, .metadata.tmp) uploaded; reached once per object
    "save.store_metadata_copied",  # DCP's .metadata.tmp copied to .metadata, not yet deleted
    "save.store_claim_released",  # the claim deleted after the manifest
    # storage/object_leftovers.py: a manager's open clearing a bucket save that died before its manifest
    "recovery.store_cleared",  # the uploads aborted and the prefix's objects deleted; its claim still there
    "recovery.store_claim_removed",  # its claim deleted
    # fsutil.atomic_write_bytes, for `latest` and the ledger's head record
    "latest.tmp_written",  # `.latest.tmp-*` written and fsynced, not yet renamed
    "latest.replaced",  # `latest` replaced, its directory not yet fsynced
    "head.tmp_written",
    "head.replaced",
    # ledger.py
    "ledger.built",  # a new ledger's table exists under a temporary name; the ledger's own name is free
    "ledger.created",  # the ledger (its table, no row) linked to its name, the directory fsynced
    "ledger.genesis_head",  # a new ledger's genesis head record written, no row yet
    "ledger.row_committed",  # a row is committed; the head record still names the row before it
    # retention.py and the stores' remove
    "retention.tombstone",  # the tombstone row is appended; the checkpoint is still on disk
    "retention.renamed",  # the checkpoint renamed to .step-N.deleting-*
    "retention.signature_removed",  # step-N.sig removed
    "retention.removed",  # the renamed directory removed
    "retention.store_manifest_deleted",  # object store: the manifest (commit record) deleted, the rest still there
    "retention.store_removed",  # object store: every object under the prefix deleted
    # lifecycle/quarantine.py and the stores: quarantine (moving a checkpoint that fails verification aside)
    "quarantine.recorded",  # the quarantine row names where it will go; nothing moved yet
    "quarantine.moved",  # step-N renamed to step-N.damaged-*
    "quarantine.signature_moved",  # step-N.sig renamed beside it
    "quarantine.latest",  # `latest` repointed (or removed) if it named the moved checkpoint
    "quarantine.store_copied",  # object store: every object copied to the aside prefix; the original still there
    "quarantine.store_manifest_deleted",  # object store: the original's manifest (its commit record) deleted
    "quarantine.store_removed",  # object store: the original's objects all deleted
    # ledger.py: a new chain
    "new_chain.built",  # the new ledger is complete under a temporary name; the old one untouched
    "new_chain.kept_aside",  # the old ledger and head record copied aside
    "new_chain.swapped",  # the new ledger renamed over the old: the new chain's commit point
)
_KNOWN = frozenset(CRASH_POINTS)

_armed: str | None = None
_armed_hit = 1
_hits = 0
_trace: list[str] | None = None


def crash_point(name: str) -> None:
    """Mark the named point (a no-op unless a test armed it or is tracing).

    Raises:
        ValueError: ``name`` is not in :data:`CRASH_POINTS` (a point must be listed to be tested).
    """
    if _armed is None and _trace is None:
        return
    if name not in _KNOWN:
        raise ValueError(
            f"unknown crash point {name!r}; add it to shardline.checkpoint.faults.crashpoints.CRASH_POINTS"
        )
    if _trace is not None:
        _trace.append(name)
    global _hits
    if name == _armed:
        _hits += 1
        if _hits == _armed_hit:
            sys.stderr.write(f"shardline: crash injected at {name} (hit {_hits})\n")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)


def arm(name: str, *, hit: int = 1) -> None:
    """End this process with ``os._exit(CRASH_EXIT_CODE)`` the ``hit``-th time it reaches ``name`` (tests only).

    Raises:
        ValueError: an unknown point, or a ``hit`` below 1.
    """
    if name not in _KNOWN:
        raise ValueError(f"unknown crash point {name!r}; the points are: {', '.join(CRASH_POINTS)}")
    if hit < 1:
        raise ValueError(f"hit counts from 1 (the first time {name} is reached), got {hit}")
    global _armed, _armed_hit, _hits
    _armed, _armed_hit, _hits = name, int(hit), 0


def disarm() -> None:
    """Stop crashing and tracing."""
    global _armed, _trace, _hits
    _armed, _trace, _hits = None, None, 0


def trace() -> None:
    """Start recording every crash point reached (read them with :func:`traced`)."""
    global _trace
    _trace = []


def traced() -> list[str]:
    """The points reached since :func:`trace`, in order (a point reached twice appears twice)."""
    return list(_trace or [])
