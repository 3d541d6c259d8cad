"""The diagnostics callback of ``shardline train`` (on by default; ``~callbacks.diagnostics`` turns it off).

At setup, rank 0 prints what was resolved -- strategy per unit, reshard policy, the mixed
precision actually applied next to what ``trainer.precision`` does (flagged when they disagree),
what the wrap and activation-checkpointing policies matched, the checkpoint state-dict kind --
and every rank logs its share of the parameters, with warnings for uneven shards and for a
unit that holds most of the model (a policy that matched almost nothing), and the collectives
of the first step by kind, unit and phase with their bytes. For the first few
steps it records memory at four points of each step (``batch_start``, ``after_backward``,
``before_optimizer_step``, ``batch_end``): the engine's accounting with its peak during the
phase that just ended, and the process's peak RSS (or CUDA peak) during it. The table goes to
each rank's log and rank 0's ``memory_phases.csv``.
"""

from __future__ import annotations

import contextlib
import csv
import logging
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.markup import escape

from shardline.diagnostics.summaries import (
    PhaseMemory,
    comm_table,
    peak_rss_bytes,
    policy_summary,
    precision_summary,
    rank_summary,
    reset_peak_rss,
    unit_summary,
)
from shardline.engine import CommCounter, count_collectives, memory_stats, reset_peak_memory_stats, subtree_units
from shardline.train.callbacks import Callback
from shardline.train.records import MEMORY_PHASES_FILE, attempt_path

if TYPE_CHECKING:
    from shardline.train.trainer import Summary, Trainer

__all__ = ["Diagnostics"]

log = logging.getLogger("shardline.train")


class Diagnostics(Callback):
    """See the module docstring. Thresholds are configurable under ``callbacks.diagnostics``."""

    def __init__(
        self, memory_steps: int = 3, dominant_unit_fraction: float = 0.5, uneven_tolerance: float = 0.25
    ) -> None:
        self.memory_steps = memory_steps
        self.dominant_unit_fraction = dominant_unit_fraction
        self.uneven_tolerance = uneven_tolerance
        self.rows: list[PhaseMemory] = []
        self._counter: CommCounter | None = None
        self._counting: contextlib.AbstractContextManager[CommCounter] | None = None
        self.setup_lines: list[str] = []
        self.warnings: list[str] = []
        self._console = Console(highlight=False, soft_wrap=True)

    # ------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: Trainer) -> None:
        cfg, model = trainer.cfg, trainer.model
        units = subtree_units(model)
        strategy = cfg.trainer.strategy
        lines = [f"strategy {strategy.name} ({strategy.sharding_strategy}), world size {trainer.info.world_size}"]
        if units:
            lines += unit_summary(units, trainer.info.world_size)
        precision_lines, precision_warnings = precision_summary(cfg.trainer.precision, trainer.policies.mixed_precision)
        lines += precision_lines
        lines += policy_summary(model, units, trainer.policies.wrap, trainer.policies.checkpointing)
        lines.append(f"checkpoint state-dict kind: {strategy.state_dict_type}")
        rank_lines, rank_warnings = rank_summary(
            trainer.info.rank,
            trainer.info.world_size,
            model,
            units,
            dominant_fraction=self.dominant_unit_fraction,
            uneven_tolerance=self.uneven_tolerance,
        )
        self.setup_lines = lines + rank_lines
        self.warnings = precision_warnings + rank_warnings
        for line in self.setup_lines:
            log.info("diagnostics: %s", line)
        for warning in self.warnings:
            log.warning("%s", warning)
        if trainer.is_rank0:
            self._console.print("[bold]diagnostics[/]")
            for line in lines + rank_lines:
                self._console.print("  " + escape(line))
        reset_peak_memory_stats(trainer.model)
        reset_peak_rss()

    # ------------------------------------------------------------------ per-phase memory
    def _mark(self, trainer: Trainer, step: int, phase: str) -> None:
        if step > trainer.start_step + self.memory_steps:
            return
        stats = memory_stats(trainer.model, optimizer=trainer.optimizer)
        measured = stats.sharded_params + stats.sharded_grads + stats.optimizer_state + stats.unsharded_grads
        cuda = None
        if trainer.device.type == "cuda":
            cuda = torch.cuda.max_memory_allocated(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
        row = PhaseMemory(
            step=step,
            phase=phase,
            engine_bytes=stats.total,
            engine_peak_bytes=measured + stats.peak_unsharded_params + stats.peak_comm_buffers,
            peak_rss_bytes=peak_rss_bytes(),
            cuda_peak_bytes=cuda,
        )
        self.rows.append(row)
        reset_peak_memory_stats(trainer.model)
        reset_peak_rss()
        if phase == "batch_end" and step == trainer.start_step + self.memory_steps:
            self._log_memory_table(trainer)

    def on_train_batch_start(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "batch_start")
        if step == trainer.start_step + 1:  # itemize the first step's collectives
            self._counting = count_collectives(trainer.model)
            self._counter = self._counting.__enter__()

    def on_after_backward(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "after_backward")

    def on_before_optimizer_step(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "before_optimizer_step")
        if self._counting is not None and self._counter is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None
            for line in comm_table(self._counter.records):
                log.info("diagnostics: %s", line)

    def on_train_batch_end(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "batch_end")  # right after the step (on_step_end waits for the read)

    def on_fit_end(self, trainer: Trainer, summary: Summary) -> None:
        if self.rows and len(self.rows) < 4 * self.memory_steps:  # the run was shorter than the window
            self._log_memory_table(trainer)

    def _log_memory_table(self, trainer: Trainer) -> None:
        log.info("diagnostics: memory per phase (peak = during the phase that ends at this point)")
        for row in self.rows:
            log.info("diagnostics: %s", row.line())
        if trainer.is_rank0:
            path = attempt_path(trainer.run_dir, MEMORY_PHASES_FILE)
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["step", "phase", "engine_mib", "engine_peak_mib", "peak_rss_mib", "cuda_peak_mib"])
                for r in self.rows:
                    cuda = "" if r.cuda_peak_bytes is None else f"{r.cuda_peak_bytes / 2**20:.3f}"
                    writer.writerow(
                        [
                            r.step,
                            r.phase,
                            f"{r.engine_bytes / 2**20:.3f}",
                            f"{r.engine_peak_bytes / 2**20:.3f}",
                            f"{r.peak_rss_bytes / 2**20:.3f}",
                            cuda,
                        ]
                    )
