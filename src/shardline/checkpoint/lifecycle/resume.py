"""Which checkpoints a resume tries, in which order: the ``resume`` argument resolved on rank 0.

``None`` (or ``"none"``, ``"false"``, ``""``): nothing. ``"auto"``: every committed checkpoint of
the directory, newest first by the ledger -- never by a clock, so after an explicit resume from an
older checkpoint the branch trained since is what ``auto`` resumes, not an abandoned one with a
higher step -- each with the manifest hash its commit row records (what loading it is verified
against), and the ``step-N`` directories whose manifest is damaged (moved aside before anything
is loaded). A path, a name inside the directory, or a URL: that checkpoint alone, which must be
one (:meth:`.CheckpointStore.find_checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardline.checkpoint.provenance.directory_rows import read_directory
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for

__all__ = [
    "RESUME_AUTO",
    "Candidate",
    "Damaged",
    "ResumeCandidates",
    "find_candidates",
    "is_auto_resume",
    "no_resume",
]

RESUME_AUTO = "auto"
"""``resume`` value that picks the newest committed checkpoint that verifies (or none)."""


def no_resume(resume: object) -> bool:
    """Whether a ``resume`` argument asks for no checkpoint: None, or ``""``, ``"none"``, ``"false"`` (any case)."""
    return resume is None or str(resume).lower() in ("", "none", "false")


def is_auto_resume(resume: object) -> bool:
    """Whether a ``resume`` argument is :data:`RESUME_AUTO` (the newest committed checkpoint that verifies)."""
    return resume is not None and str(resume) == RESUME_AUTO


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to try: where it is (as text: it crosses ranks) and the manifest hash its ledger row records
    (None when no row does)."""

    location: str
    manifest_hash: str | None


@dataclass(frozen=True)
class Damaged:
    """A ``step-N`` directory whose manifest does not verify, and how."""

    location: str
    reason: str


@dataclass(frozen=True)
class ResumeCandidates:
    """What a resume tries, newest first (``committed``), and what must be moved aside first (``damaged``)."""

    committed: tuple[Candidate, ...] = ()
    damaged: tuple[Damaged, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Plain data, for :func:`~.coord.rank0_decides`."""
        return {
            "committed": [[c.location, c.manifest_hash] for c in self.committed],
            "damaged": [[d.location, d.reason] for d in self.damaged],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ResumeCandidates:
        return cls(
            committed=tuple(Candidate(str(p), h) for p, h in data["committed"]),
            damaged=tuple(Damaged(str(p), str(r)) for p, r in data["damaged"]),
        )


def find_candidates(
    resume: str | os.PathLike[str],
    *,
    directory: Location,
    ledger: Ledger,
    storage_options: Mapping[str, Any] | None = None,
) -> ResumeCandidates:
    """Rank 0: what ``resume`` (``"auto"``, or an explicit checkpoint) tries, for the manager of ``directory``.

    Raises:
        CheckpointNotFoundError: an explicit ``resume`` that is not a checkpoint.
    """
    if is_auto_resume(resume):
        # Recorded ones from their rows, manifests not parsed; only the rows about them read (.directory_rows).
        found = read_directory(directory, ledger=ledger, rel=ledger.name_of)
        # The hash each one's newest commit row records (Ledger.recorded_hash), from the rows read once.
        recorded = {r.checkpoint: r.manifest_sha256 for r in found.rows if r.is_commit}
        candidates = tuple(
            Candidate(str(c.path), recorded.get(ledger.name_of(c.path))) for c in reversed(found.committed)
        )
        damaged = tuple(Damaged(str(d.path), d.reason) for d in found.damaged)
        return ResumeCandidates(committed=candidates, damaged=damaged)
    given = locate(resume, storage_options=storage_options)
    path = store_for(given).find_checkpoint(given, given=str(resume), directory=directory)
    return ResumeCandidates(committed=(Candidate(str(path), ledger.recorded_hash(path)),), damaged=())
