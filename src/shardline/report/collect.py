"""What a reviewer's report says about a run, gathered from its directory -- and checked, not just read.

:func:`collect_run` reads the run's summary, metrics and ledger, audits the ledger's chain
against the disk, and for every checkpoint the chain records: verifies its files against the
manifest hash its ledger row records (every byte), reads its provenance statement and checks the
statement's SHA-256 against the ledger, and checks its signature when a public key is given.
A checkpoint deleted by retention is described from its tombstone row. Nothing is modified.

A run whose checkpoints are in an object store (``checkpoint.dir=s3://...``) is reported the same
way: its ledger stays in the run directory and names each checkpoint by URL, so each is verified
in the bucket (every object streamed and hashed), its statement read from there, and the bucket
prefixes are listed for committed checkpoints the chain lacks. A bucket that cannot be reached
is an error (:class:`~shardline.errors.StorageAccessError`), not a page of failures.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.checkpoint.integrity.manifest import MANIFEST
from shardline.checkpoint.integrity.verify import VerifyLevel, verify_checkpoint
from shardline.checkpoint.lifecycle.summary import render_summary, summarize
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow, LineageReport
from shardline.checkpoint.provenance.lineage import audit, checkpoint_directories, find_ledger
from shardline.checkpoint.provenance.retention import signature_path_for, tombstone_detail
from shardline.checkpoint.provenance.statement import chain_statements
from shardline.checkpoint.storage.protocol import Location
from shardline.errors import CheckpointNotFoundError, ShardlineError, StorageAccessError
from shardline.train.records import (
    LOSS_PLOT_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    recorded_checkpoint_dirs,
    run_storage_options,
)

__all__ = ["CheckpointFacts", "RunFacts", "Status", "collect_run"]


class Status:
    """A checkpoint's verification outcome, as the report shows it."""

    VERIFIED = "verified"
    FAILED = "failed"
    DELETED = "deleted"
    MOVED = "moved aside"


@dataclass
class CheckpointFacts:
    """One checkpoint of the chain: its ledger row, what verifying it found, its provenance and signature."""

    row: LedgerRow
    path: Location
    """Where the checkpoint is: a directory, or a prefix in an object store (the row names a URL)."""
    status: str
    problems: list[str] = field(default_factory=list)
    summary_text: str | None = None
    statement: dict[str, Any] | None = None
    statement_source: str | None = None
    statement_matches_ledger: bool | None = None
    signature: Location | None = None
    signature_status: str = "not signed"
    signature_ok: bool | None = None
    tombstone: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class RunFacts:
    """Everything the report shows about one run directory."""

    run_dir: Path
    ledger_path: Path | None
    summary: dict[str, Any] | None
    metrics: list[dict[str, float]]
    val: list[tuple[int, float]]
    lineage: LineageReport | None
    lineage_error: str | None
    checkpoints: list[CheckpointFacts]
    events: list[LedgerRow]
    public_key: Path | None
    loss_png: Path | None


def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    file = run_dir / SUMMARY_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_metrics(run_dir: Path) -> tuple[list[dict[str, float]], list[tuple[int, float]]]:
    """Training loss per step and validation loss per evaluation; a step's newest row wins (resumed attempts)."""
    file = run_dir / METRICS_FILE
    steps: dict[int, float] = {}
    val: dict[int, float] = {}
    try:
        with open(file, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    step = int(row.get("step") or "")
                except ValueError:
                    continue
                if row.get("loss"):
                    steps[step] = float(row["loss"])
                if row.get("val_loss"):
                    val[step] = float(row["val_loss"])
    except OSError:
        return [], []
    return [{"step": s, "loss": steps[s]} for s in sorted(steps)], sorted(val.items())


def _check_signature(facts: CheckpointFacts, public_key: Path | None) -> None:
    sig = signature_path_for(facts.path)
    if not sig.is_file():
        return
    facts.signature = sig
    if public_key is None:
        facts.signature_status = "signed (signature file present; not checked: no public key was given to the report)"
        return
    from shardline.checkpoint.provenance.signing import verify_signature

    try:
        verify_signature(facts.path, public_key=public_key, signature=sig)
    except ShardlineError as e:
        facts.signature_ok = False
        facts.signature_status = f"signature does NOT verify: {e}"
        return
    facts.signature_ok = True
    facts.signature_status = f"signature verifies with {public_key.name} (OpenSSF model-signing, every file re-hashed)"


def _by_checkpoint(rows: list[LedgerRow]) -> tuple[dict[str, list[LedgerRow]], dict[str, list[LedgerRow]]]:
    """The rows naming each checkpoint, and the quarantine rows moving each one away (both in ledger order).

    Note: indexed once, so that finding what happened to each checkpoint after its commit row does not scan the
    whole ledger per row (quadratic: minutes for a ledger of 100k rows).
    """
    naming: dict[str, list[LedgerRow]] = {}
    moving: dict[str, list[LedgerRow]] = {}
    for r in rows:
        naming.setdefault(r.checkpoint, []).append(r)
        moved_from = tombstone_detail(r).get("checkpoint") if r.event == "quarantine" else None
        if isinstance(moved_from, str):
            moving.setdefault(moved_from, []).append(r)
    return naming, moving


def _facts(
    ledger: Ledger, row: LedgerRow, index: tuple[dict[str, list[LedgerRow]], dict[str, list[LedgerRow]]]
) -> CheckpointFacts:
    path = ledger.locate(row.checkpoint)
    naming, moving = index
    later = [r for r in naming.get(row.checkpoint, []) if r.seq > row.seq]
    tomb = next((r for r in later if r.event == "tombstone" and r.manifest_sha256 == row.manifest_sha256), None)
    moved = next((r for r in moving.get(row.checkpoint, []) if r.seq > row.seq), None)
    # Gone means no manifest: a store backed by a file system (SeaweedFS) may keep an empty prefix after a delete.
    if tomb is not None and not (path / MANIFEST).is_file():
        return CheckpointFacts(row=row, path=path, status=Status.DELETED, tombstone=tombstone_detail(tomb))
    if moved is not None:
        detail = tombstone_detail(moved)
        return CheckpointFacts(
            row=row,
            path=path,
            status=Status.MOVED,
            problems=[f"failed verification and was moved aside to {detail.get('moved_to')}: {detail.get('reason')}"],
        )
    verdict = verify_checkpoint(path, level=VerifyLevel.FULL, expected_manifest_hash=row.manifest_sha256)
    facts = CheckpointFacts(row=row, path=path, status=Status.VERIFIED if verdict.ok else Status.FAILED)
    facts.problems = [f"{p.path}: {p.kind} ({p.detail})" for p in verdict.problems]
    if verdict.error:
        facts.problems.append(verdict.error)
    try:
        facts.summary_text = render_summary(summarize(path))
    except ShardlineError as e:
        facts.problems.append(str(e))
    return facts


def collect_run(
    run_dir: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> RunFacts:
    """Gather and check what the report shows about ``run_dir`` (a run directory, or a checkpoints directory).

    ``storage_options`` reach the object store the run's checkpoints are in (default: the
    ``checkpoint.storage_options`` the run recorded in its ``config.yaml``, if any).

    Raises:
        CheckpointNotFoundError: ``run_dir`` is not a directory.
        StorageAccessError: a bucket the run's ledger names cannot be reached, listed or read.
    """
    root = Path(run_dir).absolute()
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"{run_dir} is not a run directory ({'a file' if root.exists() else 'no such directory'}); pass the "
            "directory of a training run (RUN_DIR, holding lineage.sqlite) or its checkpoints directory"
        )
    metrics, val = _read_metrics(root)
    key = Path(public_key).absolute() if public_key is not None else None
    facts = RunFacts(
        run_dir=root,
        ledger_path=None,
        summary=_read_summary(root),
        metrics=metrics,
        val=val,
        lineage=None,
        lineage_error=None,
        checkpoints=[],
        events=[],
        public_key=key,
        loss_png=(root / LOSS_PLOT_FILE) if (root / LOSS_PLOT_FILE).is_file() else None,
    )
    try:
        found = find_ledger(root)
        ledger = Ledger(found, storage_options=run_storage_options(found.parent, storage_options))
        dirs = checkpoint_directories(ledger, also=recorded_checkpoint_dirs(ledger.path.parent))
        report = audit(ledger, directories=dirs)
    except StorageAccessError:
        raise  # an unreachable bucket: nothing could be checked, so no page
    except ShardlineError as e:
        facts.lineage_error = str(e)
        return facts
    facts.ledger_path, facts.lineage = ledger.path, report
    rows = list(report.rows)
    statements = chain_statements(
        ledger.path.parent, rows, storage_options=ledger.storage_options, located=ledger.locate
    )
    index = _by_checkpoint(rows)
    for row in rows:
        if not row.is_commit:
            facts.events.append(row)
            continue
        item = _facts(ledger, row, index)
        chained = statements.get(row.seq) or {}
        item.statement = chained.get("statement")
        item.statement_source = chained.get("source")
        item.statement_matches_ledger = chained.get("matches_ledger")
        if item.statement_matches_ledger is False:
            item.problems.append("its provenance statement's SHA-256 differs from the one the ledger row records")
            if item.status == Status.VERIFIED:
                item.status = Status.FAILED
        if item.status != Status.DELETED:
            _check_signature(item, key)
            if item.signature_ok is False and item.status == Status.VERIFIED:
                item.status = Status.FAILED
        facts.checkpoints.append(item)
    return facts
