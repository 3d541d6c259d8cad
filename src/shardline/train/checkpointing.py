"""Checkpoints of a training run: when to save, what trainer state goes in, and resuming.

A run keeps its checkpoints in ``RUN_DIR/checkpoints/step-N`` -- or in ``checkpoint.dir``, a
directory or an object-store URL ``s3://BUCKET/PREFIX`` (see
:class:`shardline.checkpoint.CheckpointManager`) -- and its lineage ledger in
``RUN_DIR/lineage.sqlite`` (local, also for a bucket). The trainer state saved with each checkpoint is everything the
next step depends on besides the model and optimizer: the step (batches are a function of the
seed and the step, so the step *is* the data position), the LR scheduler, the validation
history, the fp16 loss scaler (``16-mixed``: scale and growth counter), and every rank's RNG
states. Resuming at the same world size therefore continues
bit-identically to a run that never stopped.

Note: which failures get an ``on_exception`` checkpoint. Saving is a collective, so it is only
attempted when every rank raised the same error at the same point -- a non-finite loss, which
every rank sees after the loss all-reduce (:class:`TrainingDiverged`). A single worker's
crash cannot be checkpointed safely (its peers are blocked in a collective); the launcher stops
the job and the last committed checkpoint is where ``trainer.resume=auto`` starts.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from shardline.checkpoint import CheckpointManager, SaveRequest, capture_rng_state, restore_rng_state
from shardline.checkpoint.lifecycle.manager import ON_EXCEPTION, is_auto_resume
from shardline.checkpoint.provenance.directory import checkpoint_name, has_manifest, step_of
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.state.model_state import SaveKind
from shardline.checkpoint.storage.stores import local_path
from shardline.errors import CheckpointNotFoundError
from shardline.train.best_checkpoints import measured
from shardline.train.preemption import PREEMPTED
from shardline.train.records import CHECKPOINTS_DIR, LEDGER_NAME, METRICS_FILE, checkpoint_location
from shardline.train.schema import TrainConfig

__all__ = ["TrainingCheckpoints", "TrainingDiverged", "find_resumable_run", "restart_cause"]

log = logging.getLogger("shardline.train")

SCALER_KEY = "grad_scaler"
"""The trainer state's entry for the loss scaler (``trainer.precision=16-mixed``)."""


class TrainingDiverged(FloatingPointError):
    """The global loss or gradient norm became non-finite; raised identically on every rank.

    ``step`` is the first bad step (its update, and any later one, was skipped on the device);
    ``metrics`` holds the read interval's good steps before it.
    """

    def __init__(self, message: str, *, step: int, metrics: list[Any] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.metrics = list(metrics or [])


def find_resumable_run(run_root: Path, experiment: str, *, checkpoint_dir: str = "") -> Path | None:
    """The newest run directory of ``experiment`` that holds a committed checkpoint (for ``resume=auto``).

    With ``checkpoint_dir`` an object-store URL, the newest one whose ledger records a checkpoint
    under that URL (the checkpoints are in the bucket, the ledger in the run directory).
    """
    base = run_root / experiment
    if not base.is_dir():
        return None
    prefix = str(checkpoint_dir).rstrip("/") + "/"
    for run in sorted((p for p in base.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True):
        if checkpoint_dir and local_path(checkpoint_dir) is None:  # the runs share a prefix: their ledgers say
            ledger = Ledger(run / LEDGER_NAME)
            if ledger.path.is_file() and any(r.is_commit and r.checkpoint.startswith(prefix) for r in ledger.rows()):
                return run
        elif any(has_manifest(c) for c in (run / CHECKPOINTS_DIR).glob("step-*")):
            return run
    return None


def _elastic_restart_count(world_size: int) -> int:
    """torchrun's restart count of this job: the largest over the ranks (a collective; a node that just joined
    counts from 0), 0 outside torchrun's restarts."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    mine = int(count) if count.isdigit() else 0
    counts: list[Any] = [mine] * world_size
    if world_size > 1:
        dist.all_gather_object(counts, mine)
    return max(int(c) for c in counts)


def restart_cause(*, preempted: bool, before: int | None, after: int) -> str:
    """Why a run restarted, as far as its checkpoint and world sizes tell: node_lost (fewer ranks), node_joined
    (more ranks), preempted (same size, from a preemption save), or restarted (same size: a crash, a manual
    restart, or a cause that was not recorded). A world-size change under torchrun also passes through a
    preemption save (the agent stops its workers with SIGTERM): the size change is the cause named."""
    if before is not None and after < before:
        return "node_lost"
    if before is not None and after > before:
        return "node_joined"
    if preempted:
        return "preempted"
    return "restarted"


class TrainingCheckpoints:
    """The trainer's side of checkpointing (every method is a collective)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        self.cfg = cfg.checkpoint
        # One of SAVE_KINDS: the strategy config checks it when it is built (schema.py).
        self.kind = cast(SaveKind, cfg.trainer.strategy.state_dict_type)
        self.config = cfg.to_dict()
        self.manager = CheckpointManager(
            checkpoint_location(self.cfg, run_dir),
            ledger_path=run_dir / LEDGER_NAME,
            storage_options=dict(self.cfg.storage_options or {}),
            async_save=self.cfg.async_save,
            keep_last_n=int(self.cfg.keep_last_n),
            keep_best_k=int(self.cfg.keep_best_k),
            monitor=self.cfg.monitor or None,
            mode=self.cfg.mode,
            files_per_rank=int(self.cfg.files_per_rank),
            tags=dict(cfg.tracking.tags),
            layout=self.cfg.layout,
            segment_bytes=int(self.cfg.segment_bytes),
        )
        self.last_saved_step: int | None = None
        self.recorded_global_batch: int | None = None
        """The global batch the resumed checkpoint was trained with (None: a first start or an older checkpoint)."""
        self.resumed_world_size: int | None = None
        """The world size that saved the resumed checkpoint (None: a first start or an older checkpoint)."""

    def resume(self, trainer: Any, resume: Any) -> int:
        """Load ``resume`` (``auto``, a path, or None) into the trainer; returns the step to start from.

        With ``auto``, checkpoints that fail verification are moved aside (one warning line each,
        recorded in the ledger) and the newest one that verifies is loaded. Then every save this
        run will make is checked to have a free directory, before any training is spent.
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = self.manager.load(resume, model=trainer.model, optimizer=trainer.optimizer, verify=self.cfg.verify)
        for w in caught:  # an opt-in verification level, said once, on one line
            if trainer.is_rank0 and "torch.distributed is disabled" not in str(w.message):
                log.warning("%s", w.message)
        step = 0 if state is None else int(state["step"])
        self.manager.check_free(self._planned_saves(trainer, step))
        if state is None:
            if is_auto_resume(resume):
                self._refuse_restart_over_records(trainer)
                log.info("trainer.resume=auto: no committed checkpoint yet, starting from step 0")
            return 0
        data = state.get("data") or {}
        if data.get("global_batch") is not None:
            self.recorded_global_batch = int(data["global_batch"])
        if data.get("world_size") is not None:
            self.resumed_world_size = int(data["world_size"])
        if data.get("fingerprint") not in (None, trainer.corpus.fingerprint):
            log.warning(
                "resuming on different data: the checkpoint was trained on corpus sha256 %s, this run reads %s",
                str(data["fingerprint"])[:12],
                trainer.corpus.fingerprint[:12],
            )
        trainer.scheduler.load_state_dict(state["scheduler"])
        self._restore_scaler(trainer, state, step)
        trainer.val_history = [(int(s), float(v)) for s, v in state.get("val_history", [])]
        per_rank = state.get("per_rank")
        if per_rank is not None:
            restore_rng_state(per_rank["rng"])
        else:  # more ranks than were saved: a fresh, reproducible stream for this rank
            log.warning("rank %d has no saved RNG state (the checkpoint has fewer ranks); reseeding", trainer.info.rank)
        self.last_saved_step = step
        log.info("resumed from step %d", step)
        self._record_restart(trainer, step)
        return step

    @staticmethod
    def _restore_scaler(trainer: Any, state: dict[str, Any], step: int) -> None:
        """The loss scaler's scale and growth counter (``16-mixed``); a checkpoint without them starts it fresh."""
        scaler = getattr(trainer, "scaler", None)
        if scaler is None:
            return
        saved = state.get(SCALER_KEY)
        if saved is not None:
            scaler.load_state_dict(saved)
            return
        if trainer.is_rank0:
            log.info(
                "the checkpoint of step %d holds no loss-scaler state (saved before 16-mixed runs recorded it, or by "
                "a run in another precision): the loss scale starts fresh at %s",
                step,
                scaler.get_scale(),
            )

    def _record_restart(self, trainer: Any, step: int) -> None:
        """The ledger's ``restart`` row: world size before and after, the cause as far as it is known."""
        path = self.manager.resumed_from
        if path is None:
            return
        before = self.resumed_world_size
        after = int(trainer.info.world_size)
        cause = restart_cause(
            preempted=path.name == checkpoint_name(step_of(path.name) or 0, PREEMPTED), before=before, after=after
        )
        self.manager.record_restart(
            step=step,
            checkpoint=path,
            world_size_before=before,
            world_size_after=after,
            cause=cause,
            elastic_restart=_elastic_restart_count(trainer.info.world_size),
        )
        if before is not None and before != after:
            log.warning("restart at world size %d (was %d), from %s: %s", after, before, path.name, cause)

    def _planned_saves(self, trainer: Any, start: int) -> list[int]:
        every, last = self.cfg.every_n_steps, trainer.max_steps
        steps = list(range(start + every - start % every, last + 1, every)) if every else []
        if self.cfg.save_last and last > start:
            steps.append(last)
        return steps

    def _refuse_restart_over_records(self, trainer: Any) -> None:
        """``resume=auto`` found nothing that verifies: do not start over inside a run that has records."""
        moved = self.manager.moved_aside
        records = trainer.run_dir / METRICS_FILE
        if moved and records.is_file() and records.stat().st_size > 0:
            raise CheckpointNotFoundError(
                f"trainer.resume=auto: no checkpoint in {self.manager.directory} verifies (moved aside: "
                f"{', '.join(p.name for p in moved)}), and {trainer.run_dir} holds an earlier attempt's records; "
                "starting over from step 0 here would mix two trainings. Start a new run (a new trainer.run_dir)."
            )

    def _state(self, trainer: Any, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": step,
            "scheduler": trainer.scheduler.state_dict(),
            "data": {
                "position": step,
                "seed": int(trainer.cfg.trainer.seed),
                "fingerprint": trainer.corpus.fingerprint,
                "global_batch": int(trainer.global_batch),
                "world_size": int(trainer.info.world_size),
            },
            "val_history": [[s, v] for s, v in trainer.val_history],
            "per_rank": {"rng": capture_rng_state()},
        }
        scaler = getattr(trainer, "scaler", None)
        if scaler is not None:  # the same on every rank: the overflow verdict is agreed
            state[SCALER_KEY] = scaler.state_dict()
        return state

    def save(self, trainer: Any, step: int, *, tag: str | None = None) -> None:
        """Save ``step`` (sync or async per ``checkpoint.async_save``)."""
        self.manager.save(
            SaveRequest(
                step=step,
                model=trainer.model,
                optimizer=trainer.optimizer,
                state=self._state(trainer, step),
                config=self.config,
                data_fingerprint=trainer.corpus.fingerprint,
                tag=tag,
                kind=self.kind,
                metrics=measured(trainer, step),
            )
        )
        self.last_saved_step = step
        done = "queued" if self.cfg.async_save else "saved"
        log.info("checkpoint step %d%s %s", step, f" ({tag})" if tag else "", done)

    def due(self, step: int, *, last: bool) -> bool:
        """Whether :meth:`after_step` saves at ``step`` (the trainer reads its metrics first)."""
        every = self.cfg.every_n_steps
        due = bool(every and step % every == 0) or (last and self.cfg.save_last)
        return due and self.last_saved_step != step

    def after_step(self, trainer: Any, step: int, *, last: bool) -> None:
        if self.due(step, last=last):
            self.save(trainer, step)

    def on_divergence(self, trainer: Any, step: int) -> None:
        if self.cfg.save_on_exception:
            self.save(trainer, step, tag=ON_EXCEPTION)
            self.close()

    def close(self) -> None:
        """Wait for an async save in flight (raising its error)."""
        self.manager.close()

    def finish_queued(self) -> None:
        """After training raised: let an async save already queued finish instead of abandoning it.

        Its collectives run on the manager's own group, so they progress while the training
        collectives are stuck. Its error, if any, is logged, not raised: the training error stays
        the one reported.
        """
        try:
            self.manager.close()
        except Exception as e:
            log.error("the checkpoint save queued before training failed did not complete: %s", e)
