"""Best-k retention: which checkpoints are the ``k`` best by a recorded metric, and where that value is recorded.

A save under a :class:`~shardline.checkpoint.CheckpointManager` may carry metrics
(``SaveRequest.metrics``, e.g. the validation loss of that step). They are recorded in the
checkpoint's commit row (``detail.metrics``, each value as its shortest round-trip text: the
ledger's JSON holds no floats), together with the best-k policy the manager ran under
(``detail.keep_best``), so retention and ``shardline lineage`` read them back from the ledger
after any number of restarts, without opening a checkpoint.

Rules (:func:`rank_best`):

* the ``k`` checkpoints with the best value of ``monitor`` (the lowest for ``mode="min"``, the
  highest for ``"max"``) are kept; of equal values the newer step wins;
* a checkpoint with no finite value for ``monitor`` (not recorded, NaN, infinite) is never
  kept as best (it may still be kept as one of the newest);
* retention keeps the union of the best ``k``, the newest ``keep_last_n`` and the newest
  regular checkpoint (the one a resume needs).

Note: a module of its own so that the retention loop only asks it for a set of paths to keep
(:func:`best_kept`); the ordering and tie rules live here and ``lineage`` uses the same ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from shardline.checkpoint.provenance.directory import CommittedCheckpoint
from shardline.checkpoint.provenance.ledger import QUARANTINE, TOMBSTONE, LedgerRow
from shardline.checkpoint.storage.protocol import Location
from shardline.errors import ConfigurationError

__all__ = [
    "BEST_MODES",
    "BestPolicy",
    "Ranked",
    "best_kept",
    "best_marks",
    "metrics_detail",
    "rank_best",
    "recorded_metrics",
    "recorded_policy",
]

BEST_MODES = ("min", "max")
METRICS_KEY = "metrics"
POLICY_KEY = "keep_best"

K = TypeVar("K")


@dataclass(frozen=True, kw_only=True)
class BestPolicy:
    """Keep the ``keep_best_k`` checkpoints with the best ``monitor`` value (``mode``: ``min`` or ``max``).

    ``keep_best_k=0`` (the default) keeps none as best. Raises :class:`~shardline.errors.ConfigurationError`
    for a negative or non-integer ``k``, a ``mode`` other than ``min``/``max``, or ``k > 0`` without ``monitor``.
    """

    keep_best_k: int = 0
    monitor: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        k = self.keep_best_k
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigurationError(
                f"checkpoint.keep_best_k must be a non-negative integer (0 keeps none as best), got {k!r}"
            )
        if self.mode not in BEST_MODES:
            raise ConfigurationError(
                f"checkpoint.mode must be 'min' (lower is better, e.g. a loss) or 'max' (higher is better, e.g. an "
                f"accuracy), got {self.mode!r}"
            )
        if k and not (isinstance(self.monitor, str) and self.monitor):
            raise ConfigurationError(
                f"checkpoint.keep_best_k={k} needs checkpoint.monitor, the metric that ranks checkpoints "
                f"(e.g. checkpoint.monitor=val_loss), got {self.monitor!r}"
            )

    @property
    def active(self) -> bool:
        """Whether any checkpoint is kept as best."""
        return self.keep_best_k > 0

    def describe(self) -> str:
        """``keep_best_k=2 (val_loss, min)``."""
        return f"keep_best_k={self.keep_best_k} ({self.monitor}, {self.mode})"

    def to_json(self) -> dict[str, Any]:
        """The policy as a commit row records it (``detail.keep_best``)."""
        return {"k": self.keep_best_k, "monitor": self.monitor, "mode": self.mode}


@dataclass(frozen=True)
class Ranked:
    """One checkpoint kept as best: its place (1 is the best) and its value of the monitored metric."""

    place: int
    value: float


def metrics_detail(metrics: Mapping[str, float]) -> dict[str, str]:
    """``metrics`` as a commit row records them: each value as its shortest round-trip text (``repr``)."""
    return {str(name): repr(float(value)) for name, value in sorted(metrics.items())}


def _detail(row: LedgerRow) -> dict[str, Any]:
    try:
        detail = json.loads(row.detail or "{}")
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


def recorded_metrics(row: LedgerRow) -> dict[str, float]:
    """The metrics a commit row records (empty when it records none; values that do not parse are left out)."""
    found = _detail(row).get(METRICS_KEY) if row.is_commit else None
    out: dict[str, float] = {}
    if isinstance(found, dict):
        for name, text in found.items():
            try:
                out[str(name)] = float(text)
            except (TypeError, ValueError):
                continue
    return out


def recorded_policy(rows: Iterable[LedgerRow]) -> BestPolicy | None:
    """The best-k policy of the newest commit row that records one (None: no save ran under one)."""
    policy = None
    for row in rows:
        found = _detail(row).get(POLICY_KEY) if row.is_commit else None
        if isinstance(found, dict):
            try:
                policy = BestPolicy(keep_best_k=int(found["k"]), monitor=found.get("monitor"), mode=found["mode"])
            except (KeyError, TypeError, ValueError, ConfigurationError):
                continue
    return policy if policy is not None and policy.active else None


def rank_best(entries: Sequence[tuple[K, int, float | None]], policy: BestPolicy) -> dict[K, Ranked]:
    """The best ``policy.keep_best_k`` of ``entries`` -- ``(key, step, value)``, oldest first -- with their places.

    Better values first; of equal values the newer step, then the later entry. Entries whose
    value is None or not finite are never ranked.
    """
    if not policy.active:
        return {}
    sign = 1.0 if policy.mode == "min" else -1.0
    valued = [(i, key, step, v) for i, (key, step, v) in enumerate(entries) if v is not None and math.isfinite(v)]
    valued.sort(key=lambda e: (sign * e[3], -e[2], -e[0]))
    return {key: Ranked(place=n + 1, value=v) for n, (_, key, _, v) in enumerate(valued[: policy.keep_best_k])}


def _newest_values(rows: Iterable[LedgerRow], monitor: str) -> dict[str, float | None]:
    """``manifest hash -> monitor's value`` by the newest commit row of each manifest."""
    out: dict[str, float | None] = {}
    for row in rows:
        if row.is_commit:
            out[row.manifest_sha256] = recorded_metrics(row).get(monitor)
    return out


def best_kept(
    regular: Sequence[CommittedCheckpoint], rows: Iterable[LedgerRow], policy: BestPolicy
) -> dict[Location, Ranked]:
    """Which of ``regular`` (committed regular checkpoints, oldest first) ``policy`` keeps as best, by the values
    their commit rows record."""
    if not policy.active or policy.monitor is None:
        return {}
    values = _newest_values(rows, policy.monitor)
    return rank_best([(c.path, c.step, values.get(c.manifest_hash)) for c in regular], policy)


def best_marks(rows: Sequence[LedgerRow]) -> dict[int, tuple[Ranked, BestPolicy]]:
    """``commit row seq -> (its place, the policy)`` for the checkpoints the ledger's best-k policy keeps as best:
    of regular commit rows whose checkpoint no later tombstone or quarantine accounts for (what ``lineage`` marks).
    """
    policy = recorded_policy(rows)
    if policy is None or policy.monitor is None:
        return {}
    newest: dict[str, LedgerRow] = {}
    for row in rows:
        if row.is_commit and row.tag is None:
            newest[row.checkpoint] = row
        elif row.event == TOMBSTONE or row.event == QUARANTINE:
            gone = _detail(row).get("checkpoint", row.checkpoint)
            commit = newest.get(str(gone))
            if commit is not None and (row.event == QUARANTINE or row.manifest_sha256 == commit.manifest_sha256):
                del newest[str(gone)]
    live = sorted(newest.values(), key=lambda r: r.seq)
    ranked = rank_best([(r.seq, r.step, recorded_metrics(r).get(policy.monitor)) for r in live], policy)
    return {seq: (place, policy) for seq, place in ranked.items()}
