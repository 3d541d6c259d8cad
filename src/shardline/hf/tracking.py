"""Each checkpoint a Hugging Face ``Trainer`` commits, recorded in the trackers ``report_to`` started.

After a checkpoint commits -- ``ShardlineTrainer``'s ``checkpoint-N/shardline``, or the
``checkpoint-N`` the ``LineageCallback`` adopted -- rank 0 hands its record
(:func:`shardline.checkpoint.provenance.tracker_record.tracker_record`: the manifest as an
artifact, the sharding configuration, the lineage parent and the file table) to the active MLflow
run (``mlflow.active_run()``), the W&B run (``wandb.run``) and, when it is reachable, the writer of
Trainer's ``TensorBoardCallback``, under ``checkpoint/checkpoint-N/...``, through the functions
``shardline train``'s trackers use (:mod:`shardline.checkpoint.provenance.tracker_send`). The run
tags the checkpoint recorded in its manifest go on the run too, so either side finds the other.

Note: Trainer hands a callback no handle on its integrations, so this finds their runs the way
they expose them (``mlflow.active_run()``, ``wandb.run``); TensorBoard has no such global, so
its writer is only reached from ``ShardlineTrainer``, which holds Trainer's callbacks (the
``LineageCallback`` is one of those callbacks and sees none of the others).

Note: a tracker call that fails raises ``PublishError`` on every rank (through
:func:`~shardline.checkpoint.coordination.coord.rank0_decides`), naming the tracker: the checkpoint
is committed, but the run's record would miss it, and rank 0 alone stopping would leave the
other ranks waiting in their next collective.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from shardline.checkpoint.coordination.coord import rank0_decides
from shardline.checkpoint.provenance.tracker_record import tracker_record
from shardline.checkpoint.provenance.tracker_send import (
    mlflow_checkpoints,
    mlflow_run_tags,
    tensorboard_checkpoints,
    tensorboard_run_tags,
    wandb_checkpoints,
    wandb_run_tags,
)
from shardline.errors import PublishError

__all__ = ["RunTagsCallback", "active", "attach_run_tags", "record_checkpoint", "tensorboard_writer"]


def active(name: str) -> Any:
    """The tracker module ``name`` when it is imported and has a run open (an integration started it), else None."""
    module = sys.modules.get(name)
    if module is None:
        return None
    if name == "mlflow":
        return module if module.active_run() is not None else None
    return module if getattr(module, "run", None) is not None else None


def tensorboard_writer(callbacks: Iterable[Any]) -> Any:
    """The ``SummaryWriter`` of Trainer's ``TensorBoardCallback`` among ``callbacks`` (None: none, or not open)."""
    for callback in callbacks:
        if type(callback).__name__ == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
            return callback.tb_writer
    return None


def _send(what: str, send: Callable[[], None]) -> None:
    tracker = send.__name__.removeprefix("_")
    try:
        send()
    except Exception as e:
        raise PublishError(
            f"recording {what} in the {tracker} run failed ({type(e).__name__}: {e}); what was saved is complete. "
            f"Fix the tracker (its URI, credentials, disk), or leave it out of report_to=, then resume."
        ) from e


def _to_trackers(tags: Mapping[str, str], path: str | None, name: str | None, writer: Any, what: str) -> None:
    """Rank 0: the run tags, and the record of the checkpoint at ``path`` (if any), to every tracker open."""
    mlflow, wandb = active("mlflow"), active("wandb")
    if mlflow is None and wandb is None and writer is None:
        return
    records = []
    if path is not None:
        record = tracker_record(path)
        records = [dataclasses.replace(record, name=name or record.name)]
        tags = {**record.run_tags, **tags}
    if mlflow is not None:
        from mlflow.tracking import MlflowClient

        client, run_id = MlflowClient(), mlflow.active_run().info.run_id

        def _mlflow() -> None:
            mlflow_run_tags(client, run_id, tags)
            mlflow_checkpoints(client, run_id, records)

        _send(what, _mlflow)
    if wandb is not None:

        def _wandb() -> None:
            wandb_run_tags(wandb.run, tags)
            wandb_checkpoints(wandb.run, records)

        _send(what, _wandb)
    if writer is not None:

        def _tensorboard() -> None:
            if not records:  # a record's markdown lists its run tags
                tensorboard_run_tags(writer, tags)
            tensorboard_checkpoints(writer, records)

        _send(what, _tensorboard)


def record_checkpoint(
    path: str | os.PathLike[str],
    *,
    name: str,
    tags: Mapping[str, str] | None = None,
    callbacks: Iterable[Any] = (),
) -> None:
    """Record the committed checkpoint at ``path`` in the trackers open on rank 0 (a collective: every rank calls).

    Args:
        path: The checkpoint (its manifest is read and checked).
        name: How the tracker names it (``checkpoint-N``: keys and artifacts under ``checkpoint/NAME/``).
        tags: Run tags to attach to the run besides those the checkpoint recorded.
        callbacks: Trainer's callbacks, where a ``TensorBoardCallback``'s writer is looked for.

    Raises:
        PublishError: a tracker call failed (on every rank; the checkpoint is committed).
    """
    writer = tensorboard_writer(callbacks)
    where = os.fspath(path)
    rank0_decides(lambda: _to_trackers(dict(tags or {}), where, name, writer, f"checkpoint {where}"), None)


def attach_run_tags(tags: Mapping[str, str], *, callbacks: Iterable[Any] = ()) -> None:
    """Attach run tags to the trackers' runs open on this process (call it on world process zero, where
    Trainer's integrations open them; ``callbacks``: where a ``TensorBoardCallback``'s writer is looked for).

    Raises:
        PublishError: a tracker call failed.
    """
    if tags:
        _to_trackers(dict(tags), None, None, tensorboard_writer(callbacks), "the run tags")


class RunTagsCallback(TrainerCallback):
    """Attach run tags to the trackers' runs as training begins (world process zero).

    Args:
        tags: The run tags (checked already).
        callbacks: Returns Trainer's callbacks (where a ``TensorBoardCallback``'s writer is looked for), or None.
    """

    def __init__(self, tags: Mapping[str, str], callbacks: Callable[[], Iterable[Any]] | None = None) -> None:
        self.tags = dict(tags)
        self._callbacks = callbacks

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.is_world_process_zero:
            attach_run_tags(self.tags, callbacks=self._callbacks() if self._callbacks is not None else ())
