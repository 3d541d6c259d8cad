"""The claim a save into an object store takes on its prefix, so two runs on one prefix cannot both commit.

See :func:`claim` for the design note. Also here: what the preflight's listing tells a failure
message (:func:`newest_committed`), and the line for a store that refuses writes.
"""

from __future__ import annotations

import os
import secrets
import socket

from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.integrity.manifest import MANIFEST
from shardline.checkpoint.storage.objects import ObjectPath
from shardline.errors import CheckpointError, CheckpointExistsError

__all__ = ["CLAIM", "claim", "newest_committed", "refused_message"]


CLAIM = ".shardline-claim"
"""The object a save into an object store creates first under its prefix (conditionally), and deletes before its
manifest: while it is there, the prefix is taken (see :func:`claim`)."""


def newest_committed(parent: ObjectPath, final: ObjectPath) -> str | None:
    """The newest committed regular checkpoint among ``parent``'s children (a snapshot), by step: what a failure
    message names as the last good one when no manager (no ledger) says which it is.

    Note: the preflight's listing of the parent already names every sibling; "committed" takes a
    HEAD of a manifest, tried newest first (a crashed save's prefix has none), three at most so a
    run of failed saves cannot turn a failing save's message into a scan.
    """
    steps = sorted(
        ((step, child) for child in parent.iterdir() if (step := _regular_step(child.name)) is not None),
        key=lambda pair: pair[0],
        reverse=True,
    )
    for _, child in steps[:3]:
        if child != final and (child / MANIFEST).is_file():
            return str(child)
    return None


def _regular_step(name: str) -> int | None:
    head, _, number = name.partition("-")
    return int(number) if head == "step" and number.isdigit() else None


def claim(final: ObjectPath) -> None:
    """Rank 0, object store: take the checkpoint's prefix before anything is written into it.

    Note: two runs saving into one prefix. A listing and a write are not one step, so two runs
    (two jobs given the same ``checkpoint.dir``, a job restarted while its old incarnation still
    runs) can both find ``step-N/`` free. Without a guard both would upload the same object names
    -- each overwriting the other's shards -- and both commit. So the first object of a save is
    ``step-N/.shardline-claim``, created with a conditional PUT (``If-None-Match: *``): of two
    concurrent creators the store lets exactly one succeed; the other stops here with
    :class:`CheckpointExistsError` before writing a byte. The claim stays until every shard is
    uploaded and is deleted just before the manifest (a committed checkpoint holds exactly the
    files its manifest lists), so a claim that succeeds later -- a run that listed the prefix as
    free, then stalled through a whole save of the other -- is followed by a second listing of the
    prefix: anything there but the claim means it is taken, and the late run removes its claim and
    stops. The manifest is uploaded conditionally too, so nothing commits over a committed
    checkpoint. What is left: a store that ignores ``If-None-Match`` (S3 before 2024; SeaweedFS
    4.x and MinIO honour it) gives two concurrent claims both success -- the claim is read back,
    which catches a writer that overwrote it before the read, not one after.
    """
    token = canonical_json(
        {"host": socket.gethostname(), "pid": os.getpid(), "nonce": secrets.token_hex(8), "checkpoint": str(final)}
    )
    claim = final / CLAIM
    try:
        claim.write_new(token)
        taken = claim.read_bytes() != token
    except FileExistsError:
        taken = True
    except PermissionError as e:  # the first write of the save: a store refusing writes says so here
        raise CheckpointError(refused_message(final, e, "no checkpoint was written")) from None
    if not taken and {p.name for p in final.snapshot().iterdir()} - {CLAIM}:
        final.fs.rm_file(claim.key)  # ours; what else is there belongs to a save that claimed and finished first
        raise CheckpointExistsError(
            f"checkpoint {final} already exists (objects under that prefix, written by another run while this one "
            "was starting its save); shardline never overwrites a checkpoint. Give this run its own checkpoint.dir."
        )
    if taken:
        raise CheckpointExistsError(
            f"checkpoint {final} is being saved by another run (it claimed the prefix first: {claim}); two runs must "
            "not save into one prefix. Give this run its own checkpoint.dir, or stop the other run."
        )


def refused_message(final: ObjectPath, refused: BaseException, previous: str) -> str:
    """The one line for a store that refused a write (permission, quota): endpoint, checkpoint, what to do."""
    return (
        f"the object store at {final.endpoint} refused writing checkpoint {final} ({_first_line(refused)}); "
        f"nothing was committed; {previous}. Give the credentials write access to bucket "
        f"{final.bucket!r} (or raise its quota), then resume."
    )


def _first_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
