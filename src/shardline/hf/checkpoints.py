"""Trainer's checkpoints as shardline checkpoints, and ``save_model()`` as a consolidated Hugging Face folder.

Layout of a periodic save (``save_steps``), inside Trainer's own ``checkpoint-N/``::

    checkpoint-N/
      shardline/            a shardline checkpoint: DCP shards of the model and optimizer, hashed
                            while written, manifest.json + manifest.sha256, the learning-rate
                            scheduler, the fp16 loss scaler and the run's TrainingArguments,
                            chained to its parent
      trainer_state.json    Trainer's own (step, log history, callbacks' state)
      rng_state_R.pth       Trainer's own, one per rank
    lineage.sqlite          shardline's hash-chained ledger of the run (beside the checkpoint-N)

Each save appends its commit row to ``lineage.sqlite`` (rank 0). Trainer deletes old
``checkpoint-N`` folders itself (``save_total_limit``); after each save, every checkpoint the
ledger records that is gone is recorded with a tombstone row, so the chain still verifies.

Resuming (``train(resume_from_checkpoint=...)``) verifies every byte of ``shardline/`` against
its manifest before anything is loaded, then loads the model, optimizer and scheduler at any
world size; Trainer restores its own state and RNG files as usual.

``save_model(out)`` writes the model the way ``save_pretrained`` would -- ``model.safetensors``
and ``config.json``, or for a PEFT model ``adapter_model.safetensors`` and
``adapter_config.json`` -- without gathering it: every rank writes its own shards to a
staging checkpoint inside ``out``, then rank 0 streams them into the export
(``shardline.checkpoint.consolidate``, a small batch of tensors at a time), and the staging
checkpoint is removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

import shardline.checkpoint as ckpt
from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.provenance import records
from shardline.checkpoint.provenance.ledger import LEDGER_NAME
from shardline.checkpoint.provenance.retention import record_deletions
from shardline.engine import ShardedGradScaler
from shardline.errors import CheckpointNotFoundError
from shardline.hf.resume import CHECKPOINT_DIR, INCOMPLETE, PLAIN, describe_incomplete, kind_of

__all__ = [
    "CHECKPOINT_DIR",
    "export_pretrained",
    "load_training_checkpoint",
    "record_commit",
    "record_rotations",
    "require_checkpoint",
    "save_training_checkpoint",
]

SCHEDULER_KEY = "lr_scheduler"
SCALER_KEY = "grad_scaler"
log = logging.getLogger("shardline.hf")

LEDGER_FILE = LEDGER_NAME  # the name shardline's ledger has beside every run's checkpoints


def save_training_checkpoint(
    output_dir: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    step: int,
    config: Mapping[str, Any],
    parent_manifest_hash: str | None,
    scaler: ShardedGradScaler | None = None,
    run_tags: Mapping[str, str] | None = None,
) -> ckpt.CheckpointInfo:
    """Write ``output_dir/shardline`` (a collective): model shards, optimizer (if given), scheduler and
    fp16 loss scaler state (scale and growth counter, the same on every rank); ``run_tags`` go in its manifest.

    The commit is recorded in ``lineage.sqlite`` in ``output_dir``'s parent (the run directory).
    """
    path = Path(coord.broadcast_object(os.fspath(Path(output_dir).absolute()), None)) / CHECKPOINT_DIR
    state: dict[str, Any] = {"trainer": "transformers.Trainer"}
    if scheduler is not None and optimizer is not None:
        state[SCHEDULER_KEY] = scheduler.state_dict()
    if scaler is not None:
        state[SCALER_KEY] = scaler.state_dict()
    info = ckpt.save(
        path,
        model=model,
        optimizer=optimizer,
        state=state,
        step=step,
        config=dict(config),
        parent_manifest_hash=parent_manifest_hash,
        run_tags=run_tags,
    )
    record_commit(path.parent.parent, path, info)
    return info


def require_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """``checkpoint_dir/shardline``, the same path on every rank.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` holds no shardline checkpoint (e.g. it was
            written by a plain Trainer), or is a save that did not finish.
    """
    path = Path(coord.broadcast_object(os.fspath(Path(checkpoint_dir).absolute()), None))
    kind = coord.broadcast_object(kind_of(path), None)
    if kind == INCOMPLETE:
        raise CheckpointNotFoundError(f"cannot resume from {path}: it is {describe_incomplete(path)}")
    if kind == PLAIN:
        raise CheckpointNotFoundError(
            f"{path} holds no shardline checkpoint ({CHECKPOINT_DIR}/manifest.json is missing): ShardlineTrainer "
            "resumes from the checkpoint-N folders it wrote itself. To start from weights saved by another "
            "Trainer, load them into the model before building the ShardlineTrainer (from_pretrained)."
        )
    return path / CHECKPOINT_DIR


def record_commit(run_dir: Path, checkpoint: Path, info: ckpt.CheckpointInfo) -> None:
    """Append the commit row of ``checkpoint`` to ``run_dir/lineage.sqlite`` (a collective: rank 0 writes)."""

    def append() -> None:  # nothing but the outcome crosses ranks
        ledger = ckpt.Ledger(run_dir / LEDGER_FILE)
        records.record_commit(ledger, dataclasses.replace(info, path=checkpoint), recovered=False, statement=False)

    coord.rank0_decides(append, None)


def record_rotations(run_dir: str | os.PathLike[str], reason: str) -> int:
    """Tombstone rows for recorded checkpoints that are gone from ``run_dir`` (a collective); how many."""
    run = Path(coord.broadcast_object(os.fspath(Path(run_dir).absolute()), None))

    def bury() -> int:
        ledger = ckpt.Ledger(run / LEDGER_FILE)
        if not ledger.path.is_file():
            return 0
        return len(record_deletions(ledger, reason=reason))

    return coord.rank0_decides(bury, None)


def load_training_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    verify: ckpt.VerifyLevel | str,
    scaler: ShardedGradScaler | None = None,
) -> str:
    """Verify and load ``checkpoint_dir/shardline`` into the model (and optimizer, scheduler, fp16 loss
    scaler); its manifest hash. A checkpoint saved without a loss scaler's state (before fp16 training
    saved it, or by a run in another precision) leaves ``scaler`` as it starts, and says so in the log.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` holds no shardline checkpoint (e.g. it was
            written by a plain Trainer).
    """
    target = require_checkpoint(checkpoint_dir)
    manifest, digest = coord.rank0_decides(lambda: read_manifest(target), None)
    has_optimizer = bool(manifest.get("contents", {}).get("optimizer"))
    state = ckpt.load(target, model=model, optimizer=optimizer if has_optimizer else None, verify=verify, strict=True)
    if scheduler is not None and has_optimizer and SCHEDULER_KEY in state:
        scheduler.load_state_dict(state[SCHEDULER_KEY])
    if scaler is not None and has_optimizer:
        if SCALER_KEY in state:
            scaler.load_state_dict(state[SCALER_KEY])
        else:
            log.info(
                "%s holds no loss-scaler state (saved before fp16 runs recorded it, or by a run in another "
                "precision): the loss scale starts fresh at %s",
                target,
                scaler.get_scale(),
            )
    return digest


def export_pretrained(output_dir: str | os.PathLike[str], *, model: nn.Module, step: int, adapters: bool) -> list[str]:
    """Write the model's weights as a Hugging Face folder into ``output_dir`` (a collective); the file names.

    ``adapters``: a PEFT model's adapter (``adapter_model.safetensors`` + ``adapter_config.json``),
    else the whole model (``model.safetensors`` + ``config.json``). Files of the same name in
    ``output_dir`` are replaced, as ``save_pretrained`` does; nothing else there is touched.
    """
    out = Path(coord.broadcast_object(os.fspath(Path(output_dir).absolute()), None))
    stage = out / coord.broadcast_object(f".shardline-export-{uuid.uuid4().hex[:12]}", None)
    try:
        ckpt.save(stage / "checkpoint", model=model, step=step)

        def publish() -> list[str]:
            ckpt.consolidate(stage / "checkpoint", stage / "export", adapters=adapters)
            names = sorted(p.name for p in (stage / "export").iterdir())
            for name in names:
                os.replace(stage / "export" / name, out / name)
            return names

        return coord.rank0_decides(publish, None)
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(stage, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
