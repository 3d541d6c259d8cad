"""What a run writes into its directory, written so that a resumed run never replaces an earlier attempt's files.

``metrics.csv`` is appended to (each row carries the ``attempt`` it came from: 0 for the first,
1 for the first resume...); one-off outputs -- ``summary.json``, ``loss.png``,
``memory_phases.csv``, like ``config.yaml`` -- go to the first free name among ``NAME``,
``NAME.resume-1``, ``NAME.resume-2``... (suffix kept: ``summary.resume-1.json``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["attempt_path"]


def attempt_path(run_dir: str | Path, name: str) -> Path:
    """``run_dir/name`` if it does not exist yet, else the first free ``stem.resume-N.suffix`` beside it."""
    target = Path(run_dir) / name
    stem, suffix = target.stem, target.suffix
    n = 1
    while target.exists():
        target = target.with_name(f"{stem}.resume-{n}{suffix}")
        n += 1
    return target
