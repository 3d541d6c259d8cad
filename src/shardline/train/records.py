"""What a run writes into its directory, written so that a resumed run never replaces an earlier attempt's files.

A run directory (``trainer.run_dir``, or ``<run_root>/<experiment>/<timestamp>``)::

    config.yaml         the resolved config (config.resume-N.yaml for each resumed attempt)
    metrics.csv         one row per step, appended by every attempt
    summary.json        the outcome (summary.resume-N.json ...)
    loss.png            the loss curve (with the [plot] extra)
    memory_phases.csv   memory per step phase (the diagnostics callback)
    logs/               rank<N>.log per rank; workers/ holds torch's launcher logs
    checkpoints/        step-N checkpoints (:mod:`shardline.checkpoint.provenance.directory`), unless
                        checkpoint.dir names another place (a directory, or s3://BUCKET/PREFIX)
    lineage.sqlite      the hash-chained ledger of those checkpoints (:mod:`shardline.checkpoint.provenance.ledger`)

These names are defined here, once: the callbacks write them, the launcher and resume read them,
and ``shardline report`` reads them back.

``metrics.csv`` is appended to (each row carries the ``attempt`` it came from: 0 for the first,
1 for the first resume...); one-off outputs -- ``summary.json``, ``loss.png``,
``memory_phases.csv``, like ``config.yaml`` -- go to the first free name among ``NAME``,
``NAME.resume-1``, ``NAME.resume-2``... (suffix kept: ``summary.resume-1.json``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardline.checkpoint.provenance.directory import CHECKPOINTS_DIR
from shardline.checkpoint.provenance.ledger import LEDGER_NAME
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate
from shardline.train.redaction import without_redacted

if TYPE_CHECKING:
    from shardline.train.schema import CheckpointConfig

__all__ = [
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "LEDGER_NAME",
    "LOGS_DIR",
    "LOSS_PLOT_FILE",
    "MEMORY_PHASES_FILE",
    "METRICS_FILE",
    "RECORDS",
    "SUMMARY_FILE",
    "attempt_path",
    "checkpoint_location",
    "recorded_checkpoint_dirs",
    "recorded_storage_options",
    "run_storage_options",
]

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "summary.json"
LOSS_PLOT_FILE = "loss.png"
MEMORY_PHASES_FILE = "memory_phases.csv"
LOGS_DIR = "logs"
RECORDS = (METRICS_FILE, SUMMARY_FILE)
"""The records that show a run directory already holds a training (never restarted over)."""


def checkpoint_location(checkpoint: CheckpointConfig, run_dir: str | Path) -> Location:
    """Where a run's checkpoints go: ``checkpoint.dir`` (a directory or a URL), or ``run_dir/checkpoints``.

    ``checkpoint`` is the run's ``CheckpointConfig`` (its ``dir`` and ``storage_options``).
    """
    where = str(getattr(checkpoint, "dir", "") or "")
    if not where:
        return Path(run_dir) / CHECKPOINTS_DIR
    return locate(where, storage_options=dict(getattr(checkpoint, "storage_options", None) or {}))


def recorded_checkpoint_dirs(run_dir: str | Path) -> list[str]:
    """The ``checkpoint.dir`` each attempt of the run at ``run_dir`` recorded in its ``config.yaml`` (and
    ``config.resume-N.yaml``), in order, without repeats; empty where none is recorded (the default place).

    Unreadable or malformed config files are skipped: they only add places to look, never remove one.
    """
    found: list[str] = []
    for section in _recorded_checkpoint_sections(run_dir):
        where = section.get("dir")
        if isinstance(where, str) and where and where not in found:
            found.append(where)
    return found


def run_storage_options(run_dir: str | Path, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options to reach the buckets of the run at ``run_dir``: what it recorded, overlaid by ``given``.

    The recorded options carry no credentials (they are redacted when recorded), so ``given``
    (``--storage-option``) usually adds just those to the recorded endpoint; a key given
    replaces the recorded one, nested dicts (``client_kwargs``) are merged key by key.
    """
    return _overlay(recorded_storage_options(run_dir), dict(given or {}))


def _overlay(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        out[key] = _overlay(below, value) if isinstance(below, dict) and isinstance(value, Mapping) else value
    return out


def recorded_storage_options(run_dir: str | Path) -> dict[str, Any]:
    """The ``checkpoint.storage_options`` the newest attempt of the run at ``run_dir`` recorded (empty: none).

    What ``shardline lineage`` and ``report`` use to reach the run's bucket when no
    ``--storage-option`` is given, so a run saved with options in its config is audited with them.
    """
    options: dict[str, Any] = {}
    for section in _recorded_checkpoint_sections(run_dir):
        recorded = section.get("storage_options")
        if isinstance(recorded, dict) and recorded:
            # Credentials were recorded redacted; they come from the environment or --storage-option.
            options = without_redacted(recorded)
    return options


def _recorded_checkpoint_sections(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ``checkpoint`` section of each attempt's config file, oldest first (unreadable files skipped)."""
    import yaml  # omegaconf's dependency

    root = Path(run_dir)
    stem, suffix = Path(CONFIG_FILE).stem, Path(CONFIG_FILE).suffix
    files = [root / CONFIG_FILE, *sorted(root.glob(f"{stem}.resume-*{suffix}"), key=_attempt_number)]
    sections: list[dict[str, Any]] = []
    for file in files:
        try:
            config = yaml.safe_load(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            continue
        section = config.get("checkpoint") if isinstance(config, dict) else None
        if isinstance(section, dict):
            sections.append(section)
    return sections


def _attempt_number(path: Path) -> int:
    number = path.name.split(".resume-", 1)[-1].split(".", 1)[0]
    return int(number) if number.isdigit() else 0


def attempt_path(run_dir: str | Path, name: str) -> Path:
    """``run_dir/name`` if it does not exist yet, else the first free ``stem.resume-N.suffix`` beside it."""
    target = Path(run_dir) / name
    stem, suffix = target.stem, target.suffix
    n = 1
    while target.exists():
        target = target.with_name(f"{stem}.resume-{n}{suffix}")
        n += 1
    return target
