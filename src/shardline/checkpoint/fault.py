"""Fault injection for tests: kill a rank at a chosen phase of a checkpoint save.

A testing aid, off unless the environment variable ``SHARDLINE_FAULT_INJECT`` is set when a
save starts. Its value is a comma-separated list of ``PHASE`` or ``PHASE:RANKS`` items, where
``RANKS`` is ``*`` or rank numbers joined by ``+`` (default: every rank), e.g.
``SHARDLINE_FAULT_INJECT=after_shards:1`` or ``after_manifest:0,after_shards:2+3``. A
matching rank prints one line to stderr and ends at once with ``os._exit(87)``: no cleanup,
no ``finally`` blocks, like a node that loses power. Phases, in save order:

* ``after_shards`` -- any rank, after its shard files are written and fsynced;
* ``before_manifest`` -- rank 0, after ``.metadata`` is written, before ``manifest.json``;
* ``after_manifest`` -- rank 0, after ``manifest.json``/``manifest.sha256``/``SHA256SUMS`` are
  written and fsynced, before the temporary directory is renamed (the commit point);
* ``after_rename`` -- rank 0, after the rename, before the ``latest`` pointer is updated;
* ``after_latest`` -- rank 0, after ``latest`` is updated, before the ledger row is appended.
"""

from __future__ import annotations

import os
import sys

from shardline.errors import ConfigurationError

__all__ = ["ENV_VAR", "FAULT_EXIT_CODE", "PHASES", "check_fault_spec", "maybe_fail"]

ENV_VAR = "SHARDLINE_FAULT_INJECT"
FAULT_EXIT_CODE = 87
PHASES = ("after_shards", "before_manifest", "after_manifest", "after_rename", "after_latest")


def _parse(spec: str) -> list[tuple[str, set[int] | None]]:
    items: list[tuple[str, set[int] | None]] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        phase, _, ranks = item.partition(":")
        if phase not in PHASES:
            raise ConfigurationError(
                f"{ENV_VAR}={spec!r} names the unknown phase {phase!r}; phases are {', '.join(PHASES)} "
                "(format: PHASE[:RANK[+RANK...]|:*], comma-separated)"
            )
        if ranks in ("", "*"):
            items.append((phase, None))
            continue
        try:
            items.append((phase, {int(r) for r in ranks.split("+")}))
        except ValueError:
            raise ConfigurationError(
                f"{ENV_VAR}={spec!r}: ranks {ranks!r} must be '*' or integers joined by '+', e.g. 'after_shards:0+2'"
            ) from None
    return items


def check_fault_spec() -> None:
    """Validate ``SHARDLINE_FAULT_INJECT`` (if set) so that a typo fails loudly instead of never firing."""
    spec = os.environ.get(ENV_VAR)
    if spec:
        _parse(spec)


def maybe_fail(phase: str, rank: int) -> None:
    """End this process with ``os._exit(FAULT_EXIT_CODE)`` if the fault spec names ``phase`` for ``rank``."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    for name, ranks in _parse(spec):
        if name == phase and (ranks is None or rank in ranks):
            sys.stderr.write(f"shardline: fault injected at checkpoint phase {phase!r} on rank {rank}\n")
            sys.stderr.flush()
            os._exit(FAULT_EXIT_CODE)
