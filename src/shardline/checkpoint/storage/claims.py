"""The claim a save into an object store takes on its prefix, so two runs on one prefix cannot both commit.

See :func:`claim` for the design note and :func:`judge` for when a claim is stale. Also here:
what the preflight's listing tells a failure message (:func:`newest_committed`), and the line
for a store that refuses writes.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
from dataclasses import dataclass

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.storage.objects import ObjectPath
from shardline.checkpoint.storage.protocol import COMMIT_RECORD
from shardline.errors import CheckpointError, CheckpointExistsError

__all__ = [
    "CLAIM_SUFFIX",
    "LEGACY_CLAIM",
    "MAX_CLAIM_AGE",
    "Claim",
    "claim",
    "claim_path",
    "describe_claim",
    "finished",
    "holds",
    "judge",
    "newest_committed",
    "read_claim",
    "refused_message",
    "release",
    "taken_message",
]


CLAIM_SUFFIX = ".shardline-claim"
"""``step-N.shardline-claim``, beside the prefix ``step-N/``: the object a save into an object store creates first
(conditionally) and deletes after its manifest; while it is there, the prefix is taken (see :func:`claim`)."""

LEGACY_CLAIM = ".shardline-claim"
"""Where earlier versions kept the claim: inside the prefix (``step-N/.shardline-claim``); read, never written."""

_SAVING: set[str] = set()
"""The checkpoints this process is saving now (claimed, not yet committed or given up): its claims that are live.

Note: process-wide on purpose: it answers "does a save in this process hold this claim?", which a
manager opened in the same process (after a save whose cleanup failed) must be able to ask."""

MAX_CLAIM_AGE = datetime.timedelta(hours=24)
"""A claim older than this is stale whoever holds it: no save of one checkpoint takes a day (see :func:`judge`)."""


def claim_path(final: ObjectPath) -> ObjectPath:
    """The claim object of the checkpoint prefix ``final``: ``step-N.shardline-claim`` beside it."""
    return final.with_name(final.name + CLAIM_SUFFIX)


@dataclass(frozen=True)
class Claim:
    """What a claim records: who saves into the prefix (host, process, pid namespace), for which run (its
    ledger), and a nonce that makes the object unique."""

    host: str
    pid: int
    nonce: str
    checkpoint: str
    run: str | None = None
    pidns: str | None = None

    @classmethod
    def parse(cls, data: bytes) -> Claim | None:
        """The claim in ``data``, or None when it is not one (damaged, or written by something else)."""
        try:
            fields = json.loads(data)
            return cls(
                host=str(fields["host"]),
                pid=int(fields["pid"]),
                nonce=str(fields["nonce"]),
                checkpoint=str(fields.get("checkpoint", "")),
                run=None if fields.get("run") is None else str(fields["run"]),
                pidns=None if fields.get("pidns") is None else str(fields["pidns"]),
            )
        except (ValueError, TypeError, KeyError):
            return None

    def here(self) -> bool:
        """Whether the claim was written on this machine, in this pid namespace (so its pid can be checked); a
        claim without a namespace (written by an earlier version, inside the prefix) by its host alone."""
        return self.host == socket.gethostname() and (self.pidns is None or self.pidns == _pid_namespace())


def _json(fields: dict[str, object]) -> bytes:
    """A claim's bytes: canonical JSON (sorted keys, no whitespace), as every shardline record is written."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _pid_namespace() -> str | None:
    """This process's pid namespace (two containers on one host may share a host name, never a pid namespace)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


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
        if child != final and (child / COMMIT_RECORD).is_file():
            return str(child)
    return None


def _regular_step(name: str) -> int | None:
    head, _, number = name.partition("-")
    return int(number) if head == "step" and number.isdigit() else None


def claim(final: ObjectPath, *, run: str | None = None) -> None:
    """Rank 0, object store: take the checkpoint's prefix before anything is written into it.

    ``run`` names the run saving (its ledger, see :func:`judge`); None for a save without a manager.

    Note: two runs saving into one prefix. A listing and a write are not one step, so two runs
    (two jobs given the same ``checkpoint.dir``, a job restarted while its old incarnation still
    runs) can both find ``step-N/`` free. Without a guard both would upload the same object names
    -- each overwriting the other's shards -- and both commit. So the first object of a save is
    ``step-N.shardline-claim`` beside the prefix, created with a conditional PUT
    (``If-None-Match: *``): of two concurrent creators the store lets exactly one succeed; the
    other stops here with :class:`CheckpointExistsError` before writing a byte. The claim stays
    until the manifest is up -- beside the prefix, not in it, so the committed checkpoint still
    holds exactly the files its manifest lists, and no moment exists between the claim's deletion
    and the commit in which the prefix is neither claimed nor committed. A claim that succeeds
    later -- a run that listed the prefix as free, then stalled through a whole save of the other
    -- is followed by a listing of the prefix: anything in it means it is taken, and the late run
    removes its claim and stops. The manifest is uploaded conditionally too, so nothing commits
    over a committed checkpoint, and only while the save still holds its claim (:func:`holds`): a
    claim that another run's manager cleared as stale (:func:`judge`) stops the save. What is
    left: a store that ignores ``If-None-Match`` (S3 before 2024; SeaweedFS 4.x and MinIO honour
    it) gives two concurrent claims both success -- the claim is read back, which catches a writer
    that overwrote it before the read, not one after.
    """
    token = _json(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pidns": _pid_namespace(),
            "nonce": secrets.token_hex(8),
            "checkpoint": str(final),
            "run": run,
        }
    )
    path = claim_path(final)
    try:
        path.write_new(token)
        taken = path.read_bytes() != token
    except FileExistsError:
        taken = True
    except PermissionError as e:  # the first write of the save: a store refusing writes says so here
        raise CheckpointError(refused_message(final, e, "no checkpoint was written")) from None
    except BaseException:
        _remove_if_ours(path, token)  # the PUT may have landed before the error (a response lost for good)
        raise
    crash_point("save.store_claimed")
    if not taken:
        _SAVING.add(str(final))
    if not taken and any(True for _ in final.snapshot().iterdir()):
        path.unlink()  # ours; what is in the prefix belongs to a save that claimed and finished first
        finished(final)
        raise CheckpointExistsError(
            f"checkpoint {final} already exists (objects under that prefix, written by another run while this one "
            "was starting its save); shardline never overwrites a checkpoint. Give this run its own checkpoint.dir."
        )
    if taken:
        raise CheckpointExistsError(taken_message(final))


def taken_message(final: ObjectPath) -> str:
    """The error of a save that finds ``final`` claimed: who holds the claim, and what to do."""
    path = claim_path(final)
    return (
        f"checkpoint {final} is being saved by another run: {describe_claim(path)}. Two runs must not save "
        "into one prefix: give this run its own checkpoint.dir, or stop the other run. If that run is gone, "
        f"a CheckpointManager on {final.parent} clears its claim when it opens (see docs/checkpoints.md, "
        f"'A save killed mid-upload'), or delete {path} by hand."
    )


def read_claim(path: ObjectPath) -> tuple[Claim | None, datetime.datetime | None]:
    """The claim at ``path`` and when the store last wrote it (``(None, None)`` when there is none)."""
    try:
        info = path.fs.info(path.key)
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    modified = info.get("LastModified")
    return Claim.parse(data), modified if isinstance(modified, datetime.datetime) else None


def describe_claim(path: ObjectPath) -> str:
    """``path``'s claim for a message: who holds it and since when."""
    found, modified = read_claim(path)
    since = f", written {_age(modified)} ago" if modified is not None else ""
    if found is None:
        return f"{path} (not a claim shardline can read{since})"
    return f"{path} (host {found.host}, pid {found.pid}{since})"


def _age(modified: datetime.datetime) -> str:
    seconds = max(0, int((datetime.datetime.now(datetime.timezone.utc) - modified).total_seconds()))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds // 60 % 60} min"
    return f"{seconds // 60} min {seconds % 60} s"


def judge(
    found: Claim | None,
    modified: datetime.datetime | None,
    *,
    run: str | None,
    now: datetime.datetime | None = None,
    max_age: datetime.timedelta = MAX_CLAIM_AGE,
) -> str | None:
    """Why the claim on a prefix that has no manifest is stale (a sentence), or None when a live save may hold it.

    ``run`` is the run asking (its ledger, as :func:`claim` records it), ``modified`` when the store
    wrote the claim.

    Note: when is a claim stale? A claim says a save is uploading into the prefix. Its process
    may have died (preemption, SIGKILL, a lost node) before the manifest; then nothing will ever
    delete the claim, and the prefix blocks every later save of that step. Deleting a live save's
    claim, on the other hand, lets a second run write into its prefix. So a claim is stale when
    one of these holds, in this order:

    1. It was written on this machine in this pid namespace (host name and ``/proc/self/ns/pid``
       match): its pid says -- a pid that no longer runs, or that runs a process started after
       the claim was written (the pid was reused), held a claim nobody will release. A pid that
       runs a process older than the claim holds it: live. This process's own claim is live
       while one of its saves is under way there, and stale once that save ended (its cleanup
       failed).
    2. It names this run (the same ledger): a restart of this run on another node, after its
       previous incarnation died -- the ledger has one writer, the manager opening now, so the
       incarnation that claimed is gone. (A restart on the same node is case 1, decided by pid.)
    3. It is older than ``max_age`` (:data:`MAX_CLAIM_AGE`): whoever holds it, no save of one
       checkpoint takes that long. Ages are the store's write time against this machine's clock.
    4. It is unreadable (not a claim), and older than a minute (a claim is written whole by one
       PUT, so a young unreadable one is none of ours).

    Anything else -- another run's claim, from another node, younger than ``max_age`` -- may be
    a save in progress, and is left alone; the save of that step then fails naming the claim,
    its host and pid, and how to remove it by hand if that run is gone. What real multi-node
    restarts see: rank 0 of the restarted job often runs on another host than the killed one, so
    the pid says nothing there; case 2 covers it, because the job keeps its ledger across
    restarts. A second job given the same ``checkpoint.dir`` and its own ledger is case 3 or live.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    age = now - modified if modified is not None else None
    if found is None:
        if age is None or age > datetime.timedelta(minutes=1):
            return "its claim is not one shardline wrote or can read"
        return None
    if found.here():
        if found.pid == os.getpid():
            if found.checkpoint in _SAVING:
                return None
            return "its claim is this process's, from a save that ended without removing it"
        started = _process_start(found.pid)
        if started is None:
            return f"its claim names process {found.pid} on this host, which is no longer running"
        if modified is not None and started > modified + datetime.timedelta(seconds=2):
            return f"its claim names process {found.pid} on this host, which now runs a later process (pid reused)"
        return None
    if run is not None and found.run == run:
        return f"its claim is this run's (host {found.host}, pid {found.pid}), from an incarnation that is gone"
    if age is not None and modified is not None and age > max_age:  # (age is known exactly when modified is)
        return f"its claim (host {found.host}, pid {found.pid}) is {_age(modified)} old, older than {max_age}"
    return None


def _process_start(pid: int) -> datetime.datetime | None:
    """When process ``pid`` on this machine started (UTC), or None when no such process runs.

    The start time comes from ``/proc`` (Linux); elsewhere a running process counts as started at the epoch,
    so it holds its claim.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it runs
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        seconds = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.datetime.fromtimestamp(0, datetime.timezone.utc)
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)


def holds(final: ObjectPath) -> bool:
    """Whether this process still holds the claim on ``final`` (it was not cleared as stale by another run);
    one GET."""
    try:
        found = Claim.parse(claim_path(final).read_bytes())
    except FileNotFoundError:
        return False
    return found is not None and found.here() and found.pid == os.getpid() and found.checkpoint == str(final)


def release(final: ObjectPath) -> None:
    """Delete the claim on ``final`` if this process holds it (never another run's); the save is over."""
    finished(final)
    if holds(final):
        claim_path(final).unlink()


def finished(final: ObjectPath) -> None:
    """The save of ``final`` in this process is over (committed, failed or given up): a claim of it that is still
    there is no longer live (:func:`judge`)."""
    _SAVING.discard(str(final))


def _remove_if_ours(path: ObjectPath, token: bytes) -> None:
    try:
        if path.read_bytes() == token:
            path.unlink()
    except Exception:  # the store is what failed; a claim left here is this process's, cleared as stale later
        pass


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
