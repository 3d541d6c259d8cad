"""What the user sees and keeps: progress, metrics CSV, TensorBoard, loss plot, summary.

Each callback is configured under ``callbacks.<name>`` with a ``_target_`` and removed with
``~callbacks.<name>``. Hooks receive the :class:`~shardline.train.trainer.Trainer`; output
happens on rank 0 only. :class:`Callback` is the base class of these, and may be of yours.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import IO, TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.provenance.tracker_record import committed_records
from shardline.checkpoint.provenance.tracker_send import tensorboard_checkpoints
from shardline.train.records import LEDGER_NAME, LOSS_PLOT_FILE, METRICS_FILE, SUMMARY_FILE, attempt_path

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from shardline.train.trainer import StepMetrics, Trainer
    from shardline.train.trainer import Summary as RunSummary

__all__ = ["Callback", "LossPlot", "MetricsCSV", "ProgressBar", "Summary", "TensorBoard"]

log = logging.getLogger("shardline.train")

METRIC_FIELDS = (
    "step",
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_mib",
    "comm_mib",
    "attempt",
    "world_size",
    "data_digest",
    "skipped",
)
"""``metrics.csv``'s columns. ``world_size`` is the ranks that ran the step; ``data_digest`` names the step's
global batch (its samples, in order) and is the same for a step at every world size; ``skipped`` is True for a
step whose fp16 gradients overflowed (no update; its ``grad_norm`` is empty)."""


class Callback:
    """A base class for callbacks: every hook of the training loop, typed, doing nothing.

    Optional (any object with some of these methods is a callback), but a subclass's overrides
    are checked against these signatures by a type checker. Either way, a callback's ``on_*``
    methods must be hooks: a misspelt one is refused when the callbacks are built
    (:func:`shardline.train.hooks.check_callback`). docs/training.md says when each is called.
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        """Training starts (after a resume, before the first evaluation)."""

    def on_train_batch_start(self, trainer: Trainer, step: int) -> None:
        """Step ``step`` (1-based) starts."""

    def on_after_backward(self, trainer: Trainer, step: int) -> None:
        """Every micro-batch of step ``step`` went through backward; gradients are reduced."""

    def on_before_optimizer_step(self, trainer: Trainer, step: int) -> None:
        """Gradients are clipped; the optimizer steps next."""

    def on_train_batch_end(self, trainer: Trainer, step: int) -> None:
        """Step ``step`` is done; nothing has been read from the device yet."""

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Once per step, at the end of its read interval, with the values read."""

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        """An evaluation after ``step`` (0: before training) gave ``val_loss``."""

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None:
        """Training finished (not called when it raised)."""

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        """Training raised ``error`` (about to propagate); an error raised here is logged, not raised."""


def _cell(value: object) -> str:
    """A CSV cell: floats and ints exactly (repr), text as is, None empty."""
    if value is None:
        return ""
    return value if isinstance(value, str) else repr(value)


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


class ProgressBar(Callback):
    """A live bar on rank 0 (step, loss, tokens/s, ETA) on a terminal; a line every N steps otherwise."""

    def __init__(self, refresh_per_second: float = 4.0) -> None:
        self.refresh_per_second = refresh_per_second
        self._progress: Progress | None = None
        self._task = TaskID(0)  # the bar's task, once on_fit_start made the bar
        self._console = _console()

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.is_rank0 or not self._console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("val {task.fields[val]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self._console,
            refresh_per_second=self.refresh_per_second,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=trainer.max_steps, loss="-", val="-", tps="-")

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, val=f"{val_loss:.4f}")
        elif trainer.is_rank0:
            self._console.print(f"step {step:>6}  validation loss {val_loss:.4f}")

    def on_step_end(self, trainer: Trainer, m: StepMetrics) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=m.step, loss=f"{m.loss:.4f}", tps=f"{m.tokens_per_s:,.0f}")
        elif trainer.is_rank0 and (m.step % trainer.cfg.trainer.log_every_n_steps == 0 or m.step == 1):
            remaining = (trainer.max_steps - m.step) * m.step_time_s
            norm = "skipped (fp16 overflow)" if m.grad_norm is None else f"{m.grad_norm:.3f}"
            self._console.print(
                f"step {m.step:>6}/{trainer.max_steps}  loss {m.loss:.4f}  lr {m.lr:.2e}  "
                f"grad norm {norm}  {m.tokens_per_s:,.0f} tok/s  ETA {remaining:.0f}s"
            )

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MetricsCSV(Callback):
    """``metrics.csv`` in the run directory: one row per step, plus the initial evaluation (step 0).

    Append-only: a resumed attempt adds its rows after the earlier attempts' (``attempt`` column:
    0, 1, ...), never truncating them. Steps an interrupted attempt ran past its last checkpoint
    appear again, recomputed, under the next attempt; the newest row of a step is the one the
    final model descends from.
    """

    def __init__(self, filename: str = METRICS_FILE) -> None:
        self.filename = filename
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._attempt = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.is_rank0:
            return
        path = Path(trainer.run_dir) / self.filename
        fields: list[str] = list(METRIC_FIELDS)
        exists = path.is_file() and path.stat().st_size > 0
        if exists:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                fields = list(reader.fieldnames or METRIC_FIELDS)
                self._attempt = 1 + max((int(row.get("attempt") or 0) for row in reader), default=-1)
        self._file = open(path, "a", newline="")  # noqa: SIM115 - closed at fit end
        self._writer = csv.DictWriter(self._file, fieldnames=fields, extrasaction="ignore")
        if not exists:
            self._writer.writeheader()

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        if self._writer is not None and step == 0:
            self._writer.writerow(
                {"step": 0, "val_loss": repr(val_loss), "attempt": self._attempt, "world_size": trainer.info.world_size}
            )

    def on_step_end(self, trainer: Trainer, m: StepMetrics) -> None:
        if self._writer is None or self._file is None:
            return
        row = {name: getattr(m, name) for name in METRIC_FIELDS if name != "attempt"}
        # repr() keeps every bit of the floats, so two runs can be compared exactly.
        self._writer.writerow({**{k: _cell(v) for k, v in row.items()}, "attempt": self._attempt})
        self._file.flush()

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoard(Callback):
    """TensorBoard event files under ``<run_dir>/tensorboard`` when the ``[tensorboard]`` extra is installed: the
    step metrics as scalars, and each checkpoint committed during the attempt as a markdown table in the text tab
    (``checkpoint/step-N``: manifest hash, parent, sharding, every file's rank, bytes and SHA-256)."""

    def __init__(self, subdir: str = "tensorboard") -> None:
        self.subdir = subdir
        self._writer: SummaryWriter | None = None
        self._ledger: Ledger | None = None
        self._ledger_seq = 0
        self._logged_step: int | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.is_rank0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("tensorboard is not installed (pip install 'shardline[tensorboard]'); skipping its logs")
            return
        self._writer = SummaryWriter(log_dir=str(Path(trainer.run_dir) / self.subdir))
        self._ledger = Ledger(Path(trainer.run_dir) / LEDGER_NAME)
        self._ledger_seq = max((r.seq for r in self._ledger.rows()), default=0) if self._ledger.path.is_file() else 0
        self._logged_step = trainer.checkpoints.last_saved_step  # the one resumed from is an earlier attempt's

    def on_step_end(self, trainer: Trainer, m: StepMetrics) -> None:
        if self._writer is None:
            return
        for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_mib", "comm_mib"):
            if getattr(m, name) is not None:  # grad_norm of a skipped step
                self._writer.add_scalar(f"train/{name}", getattr(m, name), m.step)
        if trainer.checkpoints.last_saved_step != self._logged_step:
            self._log_checkpoints()

    def _log_checkpoints(self) -> None:
        """Each checkpoint committed since the last look, as markdown in the text tab (``checkpoint/step-N``)."""
        if self._writer is None or self._ledger is None or not self._ledger.path.is_file():
            return
        rows = [r for r in self._ledger.rows() if r.seq > self._ledger_seq and r.is_commit]
        if rows:
            self._ledger_seq = max(r.seq for r in rows)
            self._logged_step = max(r.step for r in rows)
        tensorboard_checkpoints(self._writer, committed_records(self._ledger, rows))

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        if self._writer is not None:
            self._writer.add_scalar("val/loss", val_loss, step)

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None:
        if self._writer is not None:
            self._log_checkpoints()
            self._writer.close()
            self._writer = None


class LossPlot(Callback):
    """``loss.png``: training loss per step and validation loss at each evaluation (``[plot]`` extra)."""

    def __init__(self, filename: str = LOSS_PLOT_FILE) -> None:
        self.filename = filename

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None:
        if not trainer.is_rank0:
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.info("matplotlib is not installed (pip install 'shardline[plot]'); no loss plot")
            return
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        steps = [m.step for m in trainer.metrics]
        ax.plot(steps, [m.loss for m in trainer.metrics], label="train loss", linewidth=1.0, alpha=0.8)
        val = trainer.val_history
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation loss", linewidth=1.5)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats / byte)")
        ax.set_title(f"{summary.experiment} - {summary.strategy}, {summary.world_size} ranks")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(attempt_path(trainer.run_dir, self.filename))
        plt.close(fig)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 1024:,.0f} KiB"


class Summary(Callback):
    """A final table on rank 0 and ``summary.json`` in the run directory."""

    def __init__(self, filename: str = SUMMARY_FILE) -> None:
        self.filename = filename

    def on_fit_end(self, trainer: Trainer, summary: RunSummary) -> None:
        if not trainer.is_rank0:
            return
        attempt_path(trainer.run_dir, self.filename).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
        drop = summary.initial_val_loss - summary.final_val_loss
        rel = drop / summary.initial_val_loss if summary.initial_val_loss else math.nan
        table = Table(title=f"shardline train - {summary.experiment}", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        rows = [
            ("run directory", summary.run_dir),
            ("strategy", f"{summary.strategy}, {summary.world_size} ranks, precision {summary.precision}"),
            ("model", f"{summary.model_parameters:,} parameters"),
            ("steps / tokens", f"{summary.steps:,} / {summary.tokens:,}"),
            ("wall time", f"{summary.wall_time_s:.1f} s ({summary.median_tokens_per_s:,.0f} tokens/s median)"),
            ("validation loss", f"{summary.initial_val_loss:.4f} -> {summary.final_val_loss:.4f} ({rel:.1%} lower)"),
            ("best validation loss", f"{summary.best_val_loss:.4f}"),
            ("final train loss", f"{summary.final_train_loss:.4f} (mean of last 10 steps)"),
            ("peak memory (rank 0)", _fmt_bytes(summary.peak_mem_mib * 2**20)),
            ("corpus", f"{summary.corpus}"),
        ]
        for key, value in rows:
            table.add_row(key, value)
        _console().print(table)
