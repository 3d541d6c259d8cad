"""What a save tells an observer: the phases of the commit protocol and every write to a checkpoint file.

A :class:`SaveObserver` is passed in (``save(..., observer=...)``,
``CheckpointManager(..., observer=...)``); the default observes nothing. Tests use it to kill a
rank at a chosen phase or to make a write fail the way a full disk does
(:mod:`shardline.checkpoint.faults.fault`), so the production save path reads no environment
variable and has no test-only branch: it calls the observer at fixed points, that is all.
"""

from __future__ import annotations

import enum

__all__ = ["SaveObserver", "SavePhase"]


class SavePhase(str, enum.Enum):
    """Points of the commit protocol, in save order (see ``save.py``)."""

    AFTER_SHARDS = "after_shards"
    """Any rank, after its shard files are written and fsynced."""
    BEFORE_MANIFEST = "before_manifest"
    """Rank 0, after ``.metadata`` is written, before ``manifest.json``."""
    AFTER_MANIFEST = "after_manifest"
    """Rank 0, after the manifest files are written and fsynced, before the commit (the rename)."""
    AFTER_RENAME = "after_rename"
    """Rank 0, after the rename (committed), before ``latest`` and the ledger are updated."""
    AFTER_LATEST = "after_latest"
    """Rank 0, after ``latest`` is updated, before the ledger row is appended."""

    @classmethod
    def parse(cls, value: SavePhase | str) -> SavePhase:
        """The phase named ``value``; a ``ValueError`` listing the phases otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown save phase {value!r}; phases are {', '.join(p.value for p in cls)}") from None


class SaveObserver:
    """Hooks a save calls at fixed points; every method does nothing here. Subclass to observe or inject."""

    def on_phase(self, phase: SavePhase, rank: int) -> None:
        """Called when ``rank`` reaches ``phase`` of the commit protocol."""

    def before_write(self, path: str, nbytes: int, rank: int) -> None:
        """Called before ``nbytes`` are written to the checkpoint file ``path``; raising fails that write."""


NO_OBSERVER = SaveObserver()
