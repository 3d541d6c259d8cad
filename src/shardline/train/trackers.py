"""Experiment trackers: MLflow and Weights & Biases, as ``shardline train`` callbacks (rank 0 only).

Enable one under ``callbacks`` (in an experiment file, or ``+callbacks.mlflow._target_=...``)::

    callbacks:
      mlflow:
        _target_: shardline.train.trackers.MLflow    # pip install "shardline[mlflow]"
      wandb:
        _target_: shardline.train.trackers.WandB     # pip install "shardline[wandb]"

Both record the same things: the resolved config flattened to ``section.key`` parameters, every
step's metrics (the columns of ``metrics.csv``; the initial evaluation as ``val_loss`` at step
0), each checkpoint committed during the attempt (its manifest as an artifact, its sharding
configuration, lineage parent and size as ``checkpoint/step-N/...`` keys -- MLflow tags, W&B
summary entries, as W&B tags hold 64 characters -- and its file table of rank, path, bytes and
SHA-256: :mod:`shardline.checkpoint.provenance.tracker_record`), and at the end the run's
summary (``summary.json``) and resolved config as artifacts. The run tags (``tracking.tags``)
are attached to the run (MLflow tags, W&B tags ``KEY:VALUE``), as each checkpoint's manifest
records them. With the diagnostics callback on, its text goes along as ``diagnostics.txt`` (an
MLflow artifact; a W&B summary entry) and its memory per phase as ``diagnostics/...`` metrics.
A run that fails is marked failed (MLflow ``FAILED``, W&B exit code 1) with what
it logged so far.

Each attempt of a run (the first, and each ``trainer.resume``) is one tracker run, tagged with
the run directory and the step it resumed from: MLflow never lets a parameter change, and a
resumed attempt's config differs (``trainer.resume`` at least).

Note: only rank 0 talks to the tracker. Every rank builds the callback (the config is the same
everywhere), and the launcher builds it once more before any worker starts, so a missing package
or a bad setting is one error there (exit 2). ``__init__`` therefore only checks: it imports
nothing heavy and writes nothing.

Note: a tracker never holds up rank 0. Opening a tracker run takes seconds (MLflow's SQLite store
checks its schema, W&B starts its service process) while the other ranks already wait in the
first collective, which ``trainer.collective_timeout_s`` bounds. So every call to the tracker
runs on one background thread per tracker, in the order made; the hooks only queue work. A call
that fails stops the queue, and its error is raised on rank 0 at the next hook (which ends the
job like any worker error) or, at the end, by ``on_fit_end``, which waits for the queue to drain.

Note: where checkpoint hashes come from. The trainer saves after it reports a step, and an async
save commits in the background, so the tracker reads the run's lineage ledger -- the record of
what committed -- each time it flushes, and at the end, after the last save finished. A
checkpoint is tagged only once it is in the ledger.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import json
import logging
import queue
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from shardline.checkpoint import Ledger
from shardline.checkpoint.provenance.tracker_record import TrackerRecord, committed_records
from shardline.checkpoint.provenance.tracker_send import MLFLOW_BATCH as _MLFLOW_BATCH
from shardline.checkpoint.provenance.tracker_send import chunks as _chunks
from shardline.checkpoint.provenance.tracker_send import clip as _clip
from shardline.checkpoint.provenance.tracker_send import mlflow_checkpoints, wandb_checkpoints
from shardline.checkpoint.provenance.tracker_send import wandb_tags as _wandb_tags
from shardline.diagnostics.probe import DIAGNOSTICS_FILE, DiagnosticsProbe
from shardline.errors import ConfigurationError
from shardline.train.callbacks import Callback
from shardline.train.records import CONFIG_FILE, LEDGER_NAME, SUMMARY_FILE

if TYPE_CHECKING:
    from shardline.train.trainer import StepMetrics, Summary, Trainer

__all__ = ["WANDB_MODES", "MLflow", "RunInfo", "TrackerError", "WandB", "WandBMode", "flatten_config"]

log = logging.getLogger("shardline.train")

_METRICS = (
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_mib",
    "comm_mib",
    "skipped",
)
"""What MLflow and W&B get per step; ``skipped`` is 1.0 for a step whose fp16 gradients overflowed."""
WandBMode = Literal["offline", "online", "disabled"]
"""``callbacks.wandb.mode``: write locally for ``wandb sync`` later (default), stream to the server, or nothing."""
WANDB_MODES: tuple[str, ...] = get_args(WandBMode)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"trainer.max_steps": "600", ...}``: nested mappings joined with dots; lists and scalars as JSON text."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there means "not importable"
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _require(module: str, extra: str) -> None:
    """Raise unless ``module`` is importable (the launcher prefixes the message with ``callbacks.NAME: ``)."""
    if not _installed(module):
        raise ConfigurationError(
            f'needs the {module} package, which is not installed: pip install "shardline[{extra}]" (or remove the '
            f"callback: ~callbacks.{extra})"
        )


@dataclass(frozen=True)
class RunInfo:
    """What a tracker run is told about the shardline run (taken from the trainer on rank 0)."""

    run_dir: Path
    experiment: str
    start_step: int
    config_yaml: str


class TrackerError(RuntimeError):
    """A call to an experiment tracker failed (raised on rank 0; the job stops like on any worker error)."""


class _Tracker(Callback, abc.ABC):
    """What both trackers share: rank 0 only, metrics buffered to each read interval, checkpoints from the ledger,
    and every tracker call on a background thread (see the module docstring)."""

    name = "tracker"

    def __init__(self) -> None:
        self._active = False
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._ledger: Ledger | None = None
        self._ledger_seq = 0
        self._saved_seen: int | None = None
        self._tagged_steps: set[int] = set()
        self._every = 1

    # -- what each tracker implements (called on the background thread, in order)
    @abc.abstractmethod
    def _start(self, run: RunInfo, params: dict[str, str], tags: dict[str, str]) -> None:
        """Open the tracker's run: the resolved config as params, the run's identity as tags."""

    @abc.abstractmethod
    def _log_metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Log one burst of ``(step, {metric: value})`` rows."""

    @abc.abstractmethod
    def _log_checkpoints(self, hashes: dict[str, str], records: list[TrackerRecord]) -> None:
        """Record each newly committed checkpoint: its manifest hash keyed by its name, and its record (one for
        each checkpoint still readable: retention may have deleted one already)."""

    @abc.abstractmethod
    def _log_diagnostics(self, text: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Attach the diagnostics callback's findings: its text, and memory per phase as ``(step, metrics)`` rows."""

    @abc.abstractmethod
    def _finish(self, run: RunInfo, summary: dict[str, Any] | None, failed: BaseException | None) -> None:
        """Attach the summary and config, and close the run as finished or failed."""

    # -- the background thread
    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._raise_if_failed()
        self._jobs.put((fn, args))

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            if self._error is None:  # after a failure the rest is dropped
                try:
                    fn(*args)
                except BaseException as e:
                    self._error = e

    def _drain(self) -> None:
        """Wait until every queued call ran; stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._active = False
            raise TrackerError(f"callbacks.{self.name}: {type(error).__name__}: {error}") from error

    # -- trainer hooks
    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.is_rank0:
            return
        run_dir = Path(trainer.run_dir)
        self._ledger = Ledger(run_dir / LEDGER_NAME)
        self._ledger_seq = max((r.seq for r in self._ledger_rows()), default=0)
        self._saved_seen = trainer.checkpoints.last_saved_step  # the checkpoint resumed from: not this attempt's
        if self._saved_seen is not None:
            self._tagged_steps.add(self._saved_seen)
        self._every = max(1, int(trainer.cfg.trainer.log_every_n_steps))
        tags = {
            "shardline.run_dir": str(run_dir.absolute()),
            "shardline.experiment": str(trainer.experiment),
            "shardline.world_size": str(trainer.info.world_size),
            "shardline.resumed_from_step": str(trainer.start_step),
            **run_tags(trainer.cfg),
        }
        from shardline.train.config import to_yaml

        self._run = RunInfo(
            run_dir=run_dir.absolute(),
            experiment=str(trainer.experiment),
            start_step=int(trainer.start_step),
            config_yaml=to_yaml(trainer.cfg),
        )
        self._thread = threading.Thread(target=self._work, name=f"shardline-{self.name}", daemon=True)
        self._thread.start()
        self._active = True
        self._submit(self._start, self._run, flatten_config(trainer.cfg.to_dict()), tags)

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        if self._active and step == 0:  # later evaluations arrive with their step's metrics
            self._submit(self._log_metrics, [(0, {"val_loss": float(val_loss)})])

    def on_step_end(self, trainer: Trainer, m: StepMetrics) -> None:
        if not self._active:
            return
        values = {name: getattr(m, name) for name in _METRICS}
        self._pending.append((m.step, {k: float(v) for k, v in values.items() if v is not None}))
        # The trainer reports steps in bursts, at each read; the burst ends at one of these steps.
        if m.step % self._every == 0 or m.val_loss is not None or m.step == trainer.max_steps:
            self._flush(trainer)

    def on_fit_end(self, trainer: Trainer, summary: Summary) -> None:
        if not self._active:
            return
        try:
            self._flush(trainer, force=True)
            probe = _diagnostics(trainer)
            if probe is not None and probe.lines:
                rows = [(r.step, probe.memory_metrics(r)) for r in probe.rows]
                self._submit(self._log_diagnostics, probe.text(), rows)
            self._submit(self._finish, self._run, summary.to_dict(), None)
        finally:
            self._active = False
            self._drain()
        self._raise_if_failed()

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        if self._thread is None:
            return
        if self._active:
            self._active = False
            with contextlib.suppress(TrackerError):  # the training error is the one reported
                self._flush(trainer, force=True)
            self._jobs.put((self._finish, (self._run, None, error)))
        self._drain()
        self._raise_if_failed()

    # -- shared machinery
    def _flush(self, trainer: Trainer, *, force: bool = False) -> None:
        if self._pending:
            rows, self._pending = self._pending, []
            self._submit(self._log_metrics, rows)
        saved = trainer.checkpoints.last_saved_step
        if force or saved != self._saved_seen or self._awaiting_commit:
            self._saved_seen = saved
            self._tag_new_checkpoints()

    @property
    def _awaiting_commit(self) -> bool:
        """A save was started but its ledger row is not there yet (an async save still writing)."""
        return self._saved_seen is not None and self._saved_seen not in self._tagged_steps

    def _ledger_rows(self) -> list[Any]:
        if self._ledger is None or not self._ledger.path.is_file():
            return []
        return self._ledger.rows()

    def _tag_new_checkpoints(self) -> None:
        rows = [r for r in self._ledger_rows() if r.seq > self._ledger_seq and r.is_commit]
        if not rows:
            return
        self._ledger_seq = max(r.seq for r in rows)
        self._tagged_steps.update(r.step for r in rows)
        assert self._ledger is not None  # rows came from it
        self._submit(
            self._log_committed,
            {f"checkpoint/{Path(r.checkpoint).name}/manifest_sha256": r.manifest_sha256 for r in rows},
            self._ledger,
            rows,
        )

    def _log_committed(self, hashes: dict[str, str], ledger: Ledger, rows: list[Any]) -> None:
        # Note: on the background thread: reading each manifest may be a request to an object store.
        self._log_checkpoints(hashes, committed_records(ledger, rows))


def _diagnostics(trainer: Any) -> DiagnosticsProbe | None:
    """The probe of the run's diagnostics callback (``callbacks.diagnostics``), if it has one."""
    for callback in getattr(trainer, "callbacks", None) or []:
        probe = getattr(callback, "probe", None)
        if isinstance(probe, DiagnosticsProbe):
            return probe
    return None


def run_tags(cfg: Any) -> dict[str, str]:
    """The run tags of a ``shardline train`` config (``tracking.tags``; empty when it has none)."""
    tracking = getattr(cfg, "tracking", None)
    return dict(getattr(tracking, "tags", None) or {})


# MLflow's limits on one parameter and on one log_batch call.
_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_PARAM_VALUE = 6000
_MLFLOW_METRICS_BATCH = 1000


class MLflow(_Tracker):
    """Log the run to MLflow (``[mlflow]`` extra): a local store under the run directory unless told otherwise.

    Args:
        tracking_uri: Where runs go: any MLflow tracking URI (``http://host:5000``,
            ``sqlite:///path.db``, ``databricks``...). Default: ``sqlite:///RUN_DIR/mlflow/mlflow.db``
            with artifacts in ``RUN_DIR/mlflow/artifacts`` -- MLflow's local store (MLflow 3
            refuses the older ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set).
        experiment_name: The MLflow experiment (created if missing). Default: the shardline
            experiment (``tiny_gpt``, ``my_lm``...).
        run_name: Default: the run directory's name (plus ``resume@N`` for a resumed attempt).
    """

    name = "mlflow"

    def __init__(
        self, *, tracking_uri: str | None = None, experiment_name: str | None = None, run_name: str | None = None
    ) -> None:
        super().__init__()
        _require("mlflow", "mlflow")
        if tracking_uri is not None and (not isinstance(tracking_uri, str) or not tracking_uri.strip()):
            raise ConfigurationError(f"callbacks.mlflow.tracking_uri={tracking_uri!r}; give a tracking URI or null")
        if tracking_uri is not None and _is_file_store(tracking_uri) and not _file_store_allowed():
            raise ConfigurationError(
                f"callbacks.mlflow.tracking_uri={tracking_uri} is an MLflow file store, which this MLflow refuses "
                "unless MLFLOW_ALLOW_FILE_STORE=true is set. Set that variable, use sqlite:///PATH/mlflow.db, or "
                "leave tracking_uri unset (a local store in the run directory)."
            )
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self._client: Any = None
        self._run_id: str | None = None

    def _start(self, run: RunInfo, params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        run_dir = run.run_dir
        artifacts = None
        uri = self.tracking_uri
        if uri is None:
            (run_dir / "mlflow").mkdir(exist_ok=True)
            uri = f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}"
            artifacts = (run_dir / "mlflow" / "artifacts").as_uri()
        self.resolved_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        name = self.experiment_name or run.experiment
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(name, artifact_location=artifacts)
        )
        run_name = self.run_name or run_dir.name + (f" resume@{run.start_step}" if run.start_step else "")
        self._run_id = self._client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        from mlflow.entities import Param

        items = [
            Param(_MLFLOW_KEY.sub("_", key)[:250], _clip(value, _MLFLOW_PARAM_VALUE)) for key, value in params.items()
        ]
        for chunk in _chunks(items, _MLFLOW_BATCH):
            self._client.log_batch(self._run_id, params=chunk)
        log.info("mlflow: run %s in experiment %r at %s", self._run_id, name, uri)

    def _log_metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for step, values in rows for key, value in values.items()]
        for chunk in _chunks(metrics, _MLFLOW_METRICS_BATCH):
            self._client.log_batch(self._run_id, metrics=chunk)

    def _log_checkpoints(self, hashes: dict[str, str], records: list[TrackerRecord]) -> None:
        assert self._run_id is not None  # _start ran first, on this thread
        mlflow_checkpoints(self._client, self._run_id, records, hashes=hashes)

    def _log_diagnostics(self, text: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        self._client.log_text(self._run_id, text, DIAGNOSTICS_FILE)
        self._log_metrics(rows)

    def _finish(self, run: RunInfo, summary: dict[str, Any] | None, failed: BaseException | None) -> None:
        try:
            if summary is not None:
                self._client.log_dict(self._run_id, summary, SUMMARY_FILE)
            self._client.log_text(self._run_id, run.config_yaml, CONFIG_FILE)
        finally:
            status = "FINISHED" if failed is None else ("KILLED" if isinstance(failed, KeyboardInterrupt) else "FAILED")
            self._client.set_terminated(self._run_id, status=status)


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or ("://" not in uri and not uri.startswith(("databricks", "sqlite:")))


def _file_store_allowed() -> bool:
    """Whether this MLflow accepts a ``file:`` store (MLflow < 3.something always; later only when opted in)."""
    spec = importlib.util.find_spec("mlflow.environment_variables")
    if spec is None:
        return True
    from mlflow import environment_variables

    flag = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return flag is None or bool(flag.get())


class WandB(_Tracker):
    """Log the run to Weights & Biases (``[wandb]`` extra), offline unless configured.

    Args:
        mode: offline (the default: ``RUN_DIR/wandb/offline-run-*``, uploaded later with ``wandb
            sync``), online (needs a W&B login), or disabled.
        project: Default: the shardline experiment.
        entity: The W&B team or user (online).
        name: Default: the run directory's name (plus ``resume@N`` for a resumed attempt).
    """

    name = "wandb"

    def __init__(
        self,
        *,
        mode: WandBMode = "offline",
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        _require("wandb", "wandb")
        if mode not in WANDB_MODES:
            raise ConfigurationError(f"callbacks.wandb.mode={mode!r}; use one of {', '.join(WANDB_MODES)}")
        self.mode = mode
        self.project = project
        self.entity = entity
        self.run_name = name
        self._wb: Any = None

    def _start(self, run: RunInfo, params: dict[str, str], tags: dict[str, str]) -> None:
        import wandb

        self._wb = wandb.init(
            mode=self.mode,
            dir=str(run.run_dir),
            project=self.project or run.experiment,
            entity=self.entity,
            name=self.run_name or run.run_dir.name + (f" resume@{run.start_step}" if run.start_step else ""),
            config=params,
            tags=[*_wandb_tags(tags), *([f"resumed@{run.start_step}"] if run.start_step else [])] or None,
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._wb.summary.update(tags)
        log.info("wandb: run %s (%s) in %s", self._wb.id, self.mode, run.run_dir / "wandb")

    def _log_metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self._wb.log(values, step=step)

    def _log_checkpoints(self, hashes: dict[str, str], records: list[TrackerRecord]) -> None:
        wandb_checkpoints(self._wb, records, hashes=hashes)

    def _log_diagnostics(self, text: str, rows: list[tuple[int, dict[str, float]]]) -> None:
        # Note: summary entries, not history: the rows are of the first steps, which W&B's history is past.
        self._wb.summary.update({"diagnostics": text, **{k: v for _, values in rows for k, v in values.items()}})

    def _finish(self, run: RunInfo, summary: dict[str, Any] | None, failed: BaseException | None) -> None:
        import wandb

        try:
            if summary is not None:
                artifact = wandb.Artifact(f"{self._wb.id}-summary", type="run-report")
                with artifact.new_file(SUMMARY_FILE) as f:
                    f.write(json.dumps(summary, indent=2, default=str) + "\n")
                with artifact.new_file(CONFIG_FILE) as f:
                    f.write(run.config_yaml)
                self._wb.log_artifact(artifact)
        finally:
            self._wb.finish(exit_code=0 if failed is None else 1)
