"""Each checkpoint a shardline Lightning strategy commits, recorded in the trainer's loggers.

After ``ShardlineStrategy`` or a lineage strategy (``LineageFSDPStrategy``,
``LineageModelParallelStrategy``) commits a checkpoint, rank 0 hands its record
(:func:`shardline.checkpoint.provenance.tracker_record.tracker_record`: the manifest as an
artifact, the sharding configuration, the lineage parent and the file table) to each of the
trainer's loggers it knows -- ``MLFlowLogger``, ``WandbLogger``, ``TensorBoardLogger`` -- under
``checkpoint/NAME/...`` (``NAME``: the checkpoint directory's name, ``=`` as ``_``), through the functions
``shardline train``'s trackers use (:mod:`shardline.checkpoint.provenance.tracker_send`). The
strategy's run tags go on each logger's run as training starts, and with every checkpoint (the
tags its manifest recorded). Other loggers (``CSVLogger``...) are left alone.

Note: a logger call that fails raises ``PublishError`` on every rank (through
:func:`~shardline.checkpoint.coordination.coord.rank0_decides`): the checkpoint is committed, but
rank 0 alone stopping would leave the other ranks waiting in their next collective.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from shardline.checkpoint.coordination.coord import rank0_decides
from shardline.checkpoint.provenance.tracker_record import TrackerRecord, tracker_record
from shardline.checkpoint.provenance.tracker_send import (
    mlflow_checkpoints,
    mlflow_run_tags,
    tensorboard_checkpoints,
    tensorboard_run_tags,
    wandb_checkpoints,
    wandb_run_tags,
)
from shardline.errors import PublishError

__all__ = ["attach_run_tags", "record_checkpoint"]


_NAME = re.compile(r"[^A-Za-z0-9_\-.]")
"""What an MLflow tag key may not hold. Note: ModelCheckpoint's default names have ``=`` (``epoch=0-step=2.ckpt``),
which MLflow refuses in a key, so the record is named ``epoch_0-step_2.ckpt`` in every logger."""


def _senders(
    loggers: Iterable[Any], tags: Mapping[str, str], records: list[TrackerRecord], step: int
) -> list[tuple[str, Callable[[], None]]]:
    """One call per logger shardline knows, each sending ``tags`` and ``records`` to that logger's run."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    out: list[tuple[str, Callable[[], None]]] = []
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):

            def mlflow(logger: Any = logger) -> None:
                client, run_id = logger.experiment, logger.run_id
                mlflow_run_tags(client, run_id, tags)
                mlflow_checkpoints(client, run_id, records)

            out.append(("MLFlowLogger", mlflow))
        elif isinstance(logger, WandbLogger):

            def wandb(logger: Any = logger) -> None:
                wandb_run_tags(logger.experiment, tags)
                wandb_checkpoints(logger.experiment, records)

            out.append(("WandbLogger", wandb))
        elif isinstance(logger, TensorBoardLogger):

            def tensorboard(logger: Any = logger) -> None:
                if not records:  # a record's markdown lists its run tags
                    tensorboard_run_tags(logger.experiment, tags, step=step)
                tensorboard_checkpoints(logger.experiment, records)

            out.append(("TensorBoardLogger", tensorboard))
    return out


def _send(loggers: list[Any], tags: Mapping[str, str], path: str | None, step: int, what: str) -> None:
    """Rank 0: ``tags`` and the record of the checkpoint at ``path`` (if any) to every logger shardline knows."""
    if not loggers:
        return
    records = []
    if path is not None:
        record = tracker_record(path)
        records = [dataclasses.replace(record, name=_NAME.sub("_", record.name))]
        tags = {**record.run_tags, **tags}
    for name, send in _senders(loggers, tags, records, step):
        try:
            send()
        except Exception as e:
            raise PublishError(
                f"recording {what} in the trainer's {name} failed ({type(e).__name__}: {e}); what was saved is "
                f"complete. Fix the logger (its tracking URI, credentials, disk), or remove it, then resume."
            ) from e


def _loggers(trainer: Any) -> list[Any]:
    return list(getattr(trainer, "loggers", None) or [])


def record_checkpoint(trainer: Any, path: str | os.PathLike[str]) -> None:
    """Record the committed checkpoint at ``path`` in ``trainer``'s loggers (a collective: every rank calls; rank 0
    sends).

    Raises:
        PublishError: a logger call failed (on every rank; the checkpoint is committed).
    """
    loggers, where = _loggers(trainer), os.fspath(path)
    rank0_decides(lambda: _send(loggers, {}, where, 0, f"checkpoint {where}"), None)


def attach_run_tags(trainer: Any, tags: Mapping[str, str]) -> None:
    """Attach the run tags to the runs of ``trainer``'s loggers (a collective: every rank calls; rank 0 sends).

    Raises:
        PublishError: a logger call failed (on every rank).
    """
    if tags:
        loggers = _loggers(trainer)
        rank0_decides(lambda: _send(loggers, dict(tags), None, 0, "the run tags"), None)
