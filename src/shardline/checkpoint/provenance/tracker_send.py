"""Handing :class:`~.tracker_record.TrackerRecord` s and run tags to a tracker's own client: MLflow, W&B, TensorBoard.

One function per tracker and per kind of record, each given the client object of a run that is
already open -- an ``MlflowClient`` and run id, a ``wandb`` run, a TensorBoard ``SummaryWriter``
-- so every front end records a checkpoint the same way: ``shardline train``'s trackers
(:mod:`shardline.train.trackers`, its TensorBoard callback), ``ShardlineTrainer`` and the HF
``LineageCallback`` (:mod:`shardline.hf.tracking`), and the Lightning strategies
(:mod:`shardline.lightning.tracking`). Nothing here imports a tracker at module level, and
nothing here opens or closes a run: that is the front end's.

What goes where (per checkpoint ``NAME``):

* MLflow: tags ``checkpoint/NAME/...`` (manifest hash, parent, step, files, bytes, world size,
  mesh, strategy, state-dict kind, engine), the artifact ``checkpoint/NAME/manifest.json`` (the
  manifest byte for byte) and the table ``checkpoint/NAME/files.json`` (rank, path, bytes,
  SHA-256). Run tags: one MLflow tag each, ``KEY: VALUE``.
* W&B: summary entries ``checkpoint/NAME/...``, and an artifact of type ``checkpoint-manifest``
  holding ``manifest.json`` and the ``files`` table. Run tags: W&B run tags ``KEY:VALUE`` (64
  characters at most) and summary entries ``run_tags/KEY`` with the full values.
* TensorBoard: the record as markdown in the text tab at ``checkpoint/NAME``; run tags as a
  markdown table at ``run_tags``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from shardline.checkpoint.provenance.tracker_record import FILE_COLUMNS, TrackerRecord

__all__ = [
    "MLFLOW_BATCH",
    "chunks",
    "clip",
    "mlflow_checkpoints",
    "mlflow_run_tags",
    "tensorboard_checkpoints",
    "tensorboard_run_tags",
    "wandb_checkpoints",
    "wandb_run_tags",
    "wandb_tags",
]

MLFLOW_BATCH = 100
"""The most parameters or tags one MLflow ``log_batch`` call takes."""
_T = TypeVar("_T")


def chunks(items: list[_T], size: int) -> Iterator[list[_T]]:
    """``items`` in consecutive lists of at most ``size``."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wandb_tags(tags: Mapping[str, str]) -> list[str]:
    """The user's run tags as W&B run tags, ``KEY:VALUE`` (W&B holds 64 characters a tag); ``shardline.*`` left out."""
    return [clip(f"{k}:{v}", 64) for k, v in tags.items() if not k.startswith("shardline.")]


def _flat(records: Iterable[TrackerRecord], hashes: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(hashes or {})
    for record in records:
        out.update(record.flat())
    return out


def mlflow_checkpoints(
    client: Any, run_id: str, records: list[TrackerRecord], *, hashes: Mapping[str, str] | None = None
) -> None:
    """Record ``records`` in the MLflow run ``run_id`` through ``client`` (an ``MlflowClient``).

    ``hashes``: more ``checkpoint/NAME/manifest_sha256`` tags, for checkpoints whose record could not be read
    (retention deleted one already).
    """
    from mlflow.entities import RunTag

    for chunk in chunks([RunTag(k, v) for k, v in _flat(records, hashes).items()], MLFLOW_BATCH):
        client.log_batch(run_id, tags=chunk)
    for record in records:
        # Note: the manifest's own bytes, so the downloaded file's SHA-256 is the manifest hash.
        client.log_text(run_id, record.manifest_json.decode("utf-8"), f"{record.prefix}/manifest.json")
        client.log_table(run_id, data=record.columns(), artifact_file=f"{record.prefix}/files.json")


def mlflow_run_tags(client: Any, run_id: str, tags: Mapping[str, str]) -> None:
    """Attach the run tags to the MLflow run ``run_id`` (one MLflow tag each; ``search_runs("tags.KEY = ...")``)."""
    from mlflow.entities import RunTag

    for chunk in chunks([RunTag(k, v) for k, v in tags.items()], MLFLOW_BATCH):
        client.log_batch(run_id, tags=chunk)


def wandb_checkpoints(run: Any, records: list[TrackerRecord], *, hashes: Mapping[str, str] | None = None) -> None:
    """Record ``records`` in the W&B ``run``: summary entries, and one ``checkpoint-manifest`` artifact each."""
    import wandb

    run.summary.update(_flat(records, hashes))
    for record in records:
        # Note: the table goes in the artifact, not the history: a checkpoint commits (async) after later
        # steps were logged, and W&B drops history rows for a step below the current one.
        artifact = wandb.Artifact(
            f"{run.id}-{record.name}",
            type="checkpoint-manifest",
            description=f"manifest {record.manifest_sha256}",
            metadata={**record.flat(), **{f"run_tags/{k}": v for k, v in record.run_tags.items()}},
        )
        with artifact.new_file("manifest.json", mode="xb") as f:
            f.write(record.manifest_json)
        artifact.add(wandb.Table(columns=list(FILE_COLUMNS), data=record.rows()), "files")
        run.log_artifact(artifact)


def wandb_run_tags(run: Any, tags: Mapping[str, str]) -> None:
    """Attach the run tags to the W&B ``run``: run tags ``KEY:VALUE`` (kept with the run's own) and summary entries
    ``run_tags/KEY`` (the full values)."""
    new = [t for t in wandb_tags(tags) if t not in (run.tags or ())]
    if new:
        run.tags = (*(run.tags or ()), *new)
    run.summary.update({f"run_tags/{k}": v for k, v in tags.items()})


def tensorboard_checkpoints(writer: Any, records: list[TrackerRecord]) -> None:
    """Write each record as markdown to the text tab of ``writer`` (a ``SummaryWriter``), at ``checkpoint/NAME``."""
    for record in records:
        writer.add_text(record.prefix, record.markdown(), record.step)


def tensorboard_run_tags(writer: Any, tags: Mapping[str, str], *, step: int = 0) -> None:
    """Write the run tags as a markdown table to the text tab of ``writer``, at ``run_tags``."""
    if tags:
        rows = "\n".join(f"| {k} | `{v}` |" for k, v in tags.items())
        writer.add_text("run_tags", f"| tag | value |\n|---|---|\n{rows}\n", step)
