"""Which ``checkpoint-N`` a ``train()`` resumes from, and what becomes of the checkpoints after it.

Trainer saves ``checkpoint-N`` folders in ``output_dir``. Before training starts (a
collective: rank 0 decides, every rank learns the outcome or the same error),
:func:`prepare_resume` looks at them:

* A folder is **complete** when it holds a committed shardline checkpoint
  (``shardline/manifest.json``) and Trainer's ``trainer_state.json``. A process killed while
  saving leaves an **incomplete** one: ``.shardline.tmp-*`` (the save's temporary directory)
  and no manifest, or a committed ``shardline/`` without Trainer's state written after it. One
  with ``trainer_state.json`` and no ``shardline/`` at all is a plain Trainer's save (refused
  when loaded, see :func:`shardline.hf.checkpoints.require_checkpoint`).
* ``resume_from_checkpoint=True`` takes the newest folder that is not incomplete, with a warning
  naming each incomplete one it passes over. An explicit path to an incomplete one is refused,
  naming what is missing and the newest complete checkpoint.
* Going back: training from step K makes every ``checkpoint-N`` with N > K part of an abandoned
  branch -- the coming saves would land on their names. Trainer overwrites them; shardline never
  overwrites a checkpoint, so each is moved, whole, to ``output_dir/abandoned/checkpoint-N.<UTC
  time>`` (a name Trainer's ``get_last_checkpoint`` and ``save_total_limit`` never consider).
  A recorded shardline checkpoint gets a ``tombstone`` row in the ledger first, whose reason
  says where it went, so ``shardline lineage`` still verifies and the moved checkpoint itself
  still verifies where it now is. A fresh start (no resume) over committed checkpoints is refused
  instead, before training: it is more often a forgotten ``resume_from_checkpoint`` than a wish
  to discard the run. Incomplete saves hold nothing committed and are moved aside in every case.

Note: record, then move (as the checkpoint package's quarantine does). A crash between the row
and the rename leaves the folder in place with a tombstone for exactly its manifest; the next
``train()`` moves it without a second row.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from pathlib import Path
from typing import Literal

from shardline._transformers_compat import PREFIX_CHECKPOINT_DIR, TRAINER_STATE_NAME
from shardline.checkpoint.coordination.coord import rank0_decides
from shardline.checkpoint.integrity.manifest import MANIFEST, read_manifest
from shardline.checkpoint.provenance.directory import move_aside
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, TOMBSTONE, Ledger
from shardline.checkpoint.provenance.records import record_tombstone
from shardline.checkpoint.storage.fsutil import fsync_dir, is_tmp_name, tmp_in_use
from shardline.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, IntegrityError

__all__ = [
    "ABANDONED_DIR",
    "CHECKPOINT_DIR",
    "checkpoints_in",
    "describe_incomplete",
    "kind_of",
    "move_to_abandoned",
    "prepare_resume",
]

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "shardline"
"""The shardline checkpoint's folder inside Trainer's ``checkpoint-N``."""
ABANDONED_DIR = "abandoned"
"""Where the checkpoints of an abandoned branch (and incomplete saves) are moved, inside ``output_dir``."""
_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
COMPLETE, INCOMPLETE, PLAIN = "complete", "incomplete", "plain"


def _leftovers(folder: Path) -> list[str]:
    """Temporary directories of saves into ``folder`` that never committed (``.shardline.tmp-*``)."""
    try:
        return sorted(p.name for p in folder.iterdir() if p.is_dir() and is_tmp_name(p.name))
    except OSError:
        return []


def _missing(folder: Path) -> list[str]:
    missing = [] if (folder / CHECKPOINT_DIR / MANIFEST).is_file() else [f"{CHECKPOINT_DIR}/{MANIFEST}"]
    return missing + ([] if (folder / TRAINER_STATE_NAME).is_file() else [TRAINER_STATE_NAME])


def kind_of(folder: Path) -> str:
    """``complete``, ``incomplete`` (a save that did not finish) or ``plain`` (written by another Trainer)."""
    if not _missing(folder):
        return COMPLETE
    if (folder / CHECKPOINT_DIR).exists() or _leftovers(folder):
        return INCOMPLETE  # a shardline save began here
    if (folder / TRAINER_STATE_NAME).is_file() or not _NAME.match(folder.name):
        return PLAIN  # Trainer's own save, or no checkpoint at all: refused when loaded
    return INCOMPLETE  # a checkpoint-N folder with nothing committed in it


def describe_incomplete(folder: Path) -> str:
    """What an incomplete ``checkpoint-N`` holds and lacks, in words ("an incomplete save (...)")."""
    leftovers = _leftovers(folder)
    held = f"{', '.join(leftovers)}, the temporary directory of a save that did not finish; " if leftovers else ""
    return f"an incomplete save ({held}no {' and no '.join(_missing(folder))})"


def checkpoints_in(run: Path) -> list[tuple[int, Path]]:
    """``(N, path)`` of every ``checkpoint-N`` folder in ``run``, by step."""
    if not run.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def _newest_complete(run: Path) -> Path | None:
    return next((p for _, p in reversed(checkpoints_in(run)) if kind_of(p) == COMPLETE), None)


def _step_of(folder: Path) -> int:
    """The global step Trainer resumes ``folder`` at (its ``trainer_state.json``; else the name's N)."""
    try:
        return int(json.loads((folder / TRAINER_STATE_NAME).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _NAME.match(folder.name)
        return int(m.group(1)) if m else 0


def _newest_hint(run: Path) -> str:
    newest = _newest_complete(run)
    if newest is None:
        return f"{run} holds no complete checkpoint"
    return f"the newest complete checkpoint is {newest} (resume_from_checkpoint=True picks it)"


def _choose(run: Path, resume: str | Literal[True]) -> Path:
    """Rank 0: the folder to resume from (see the module docstring)."""
    if resume is True:
        passed: list[Path] = []
        for _, folder in reversed(checkpoints_in(run)):
            if kind_of(folder) == INCOMPLETE:
                passed.append(folder)
                continue
            for skipped in passed:
                log.warning(
                    "resume_from_checkpoint=True: skipping %s, %s; resuming from %s",
                    skipped.name,
                    describe_incomplete(skipped),
                    folder.name,
                )
            return folder
        raise CheckpointNotFoundError(
            f"resume_from_checkpoint=True found no complete checkpoint in {run}"
            + (
                f" ({'; '.join(f'{p.name} is {describe_incomplete(p)}' for p in passed)})"
                if passed
                else " (no checkpoint-N folder)"
            )
            + ": start without resume_from_checkpoint (the incomplete ones are moved to "
            f"{ABANDONED_DIR}/), or pass the path of a complete checkpoint-N folder"
        )
    folder = Path(resume).absolute()
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"cannot resume from {resume}: no such directory; {_newest_hint(run)}")
    if (folder / MANIFEST).is_file():
        raise CheckpointNotFoundError(
            f"cannot resume from {folder}: it is a shardline checkpoint itself; pass the Trainer folder that holds it "
            f"as {CHECKPOINT_DIR}/ beside trainer_state.json (e.g. {folder.parent})"
        )
    if kind_of(folder) == INCOMPLETE:
        raise CheckpointNotFoundError(
            f"cannot resume from {folder}: it is {describe_incomplete(folder)}. Its save was interrupted (the process "
            f"was killed or failed while writing it), so there is nothing to load; {_newest_hint(folder.parent)}."
        )
    return folder


def _tombstone_for(ledger: Ledger, run: Path, folder: Path, reason: str, moved_to: Path, inner: str) -> None:
    """Rank 0: the ``tombstone`` row of ``folder``'s shardline checkpoint (``folder/inner``), if the ledger records
    it (once)."""
    if not ledger.path.is_file() or not (folder / inner / MANIFEST).is_file():
        return
    name = os.path.relpath(folder / inner, run)
    rows = ledger.rows()
    commit = next((r for r in reversed(rows) if r.is_commit and r.checkpoint == name), None)
    if commit is None:
        return  # not in the chain: nothing to account for
    digest = commit.manifest_sha256
    try:
        if read_manifest(folder / inner)[1] != digest:
            return  # the disk holds another checkpoint than the row records: `shardline lineage` reports it
    except IntegrityError as e:  # damaged: still the recorded checkpoint's place, moved aside all the same
        reason = f"{reason} (its manifest does not read: {e})"
    if any(r.event == TOMBSTONE and r.checkpoint == name and r.manifest_sha256 == digest for r in rows):
        return  # recorded by a train() a crash interrupted before its move
    moved = os.path.relpath(moved_to / inner, run)
    reason = f"{reason}; moved aside to {moved}"
    record_tombstone(ledger, of=commit, checkpoint=name, reason=reason, moved_to=moved, commit_row=commit.seq)


def _aside(run: Path, folder: Path) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = run / ABANDONED_DIR / f"{folder.name}.{stamp}"
    n = 1
    while target.exists():
        target = run / ABANDONED_DIR / f"{folder.name}.{stamp}-{n}"
        n += 1
    return target


def move_to_abandoned(run: Path, folder: Path, reason: str, *, inner: str = CHECKPOINT_DIR) -> None:
    """Rank 0: record (if its shardline part, ``folder/inner``, is in the ledger), then move ``folder`` to
    ``abandoned/``. ``inner`` is ``""`` where the whole folder is under lineage (adopted by ``LineageCallback``)."""
    target = _aside(run, folder)
    _tombstone_for(Ledger(run / LEDGER_NAME), run, folder, reason, target, inner)
    if not target.parent.is_dir():
        target.parent.mkdir()
        fsync_dir(run)
    move_aside(folder, target)
    fsync_dir(target.parent)
    log.warning("moved %s aside to %s: %s", folder.name, os.path.relpath(target, run), reason)


def _decide(output_dir: str, resume: str | Literal[True] | None) -> str | None:
    """Rank 0: see :func:`prepare_resume`; plain data out."""
    run = Path(output_dir).absolute()
    chosen = _choose(run, resume) if resume is not None else None
    if chosen is not None and kind_of(chosen) == PLAIN:
        return str(chosen)  # refused when Trainer loads it, with the message for a plain Trainer's save
    start = _step_of(chosen) if chosen is not None else 0
    later = [p for n, p in checkpoints_in(run) if n > start and p != chosen]
    if not later:
        return None if chosen is None else str(chosen)
    if chosen is None:
        committed = [p for p in later if kind_of(p) != INCOMPLETE]
        if committed:
            newest = _newest_complete(run)
            raise CheckpointExistsError(
                f"{run} already holds {', '.join(p.name for p in committed)} from an earlier run, and this train() "
                "starts from step 0: its saves would take those names, and shardline never overwrites a checkpoint. "
                + (f"To continue that run, train(resume_from_checkpoint=True) (from {newest.name}); " if newest else "")
                + "to go back to one of them, train(resume_from_checkpoint='<output_dir>/checkpoint-N') (the later "
                f"ones are moved to {ABANDONED_DIR}/ and recorded in the ledger); to start over, use a new "
                "output_dir or move those folders away."
            )
    busy = [folder / name for folder in later for name in _leftovers(folder) if tmp_in_use(folder / name)]
    if busy:
        raise CheckpointError(
            f"{busy[0]} is being written by a save in another process: is another run training in {run}? Give each "
            "run its own output_dir. Nothing was moved."
        )
    back_to = "step 0" if chosen is None else chosen.name if chosen.parent == run else str(chosen)
    for folder in later:
        if kind_of(folder) == INCOMPLETE:
            move_to_abandoned(run, folder, describe_incomplete(folder))
        else:
            move_to_abandoned(run, folder, f"abandoned: training went back to {back_to} (step {start})")
    return None if chosen is None else str(chosen)


def prepare_resume(output_dir: str | os.PathLike[str], resume: str | os.PathLike[str] | bool | None) -> str | None:
    """The checkpoint folder a ``train(resume_from_checkpoint=resume)`` loads, after the folders after it
    were moved aside (a collective; see the module docstring). None: start from step 0.

    Raises:
        CheckpointNotFoundError: an explicit path that does not exist or is an incomplete save, or
            ``True`` with no complete checkpoint in ``output_dir``.
        CheckpointExistsError: a fresh start (``resume`` None) over committed checkpoints.
        CheckpointError: a later checkpoint is still being written by another process.
    """
    if resume is False:
        resume = None
    value: str | Literal[True] | None = resume if resume is None or resume is True else os.fspath(resume)
    return rank0_decides(lambda: _decide(os.fspath(output_dir), value), None)
