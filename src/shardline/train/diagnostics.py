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

What is measured and how it reads is :class:`shardline.diagnostics.probe.DiagnosticsProbe`'s,
which the Lightning and HF Trainer callbacks drive too; this callback prints and writes it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from shardline.diagnostics.probe import DiagnosticsProbe, Setup
from shardline.diagnostics.summaries import PhaseMemory
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
        self.probe = DiagnosticsProbe(
            memory_steps=memory_steps, dominant_unit_fraction=dominant_unit_fraction, uneven_tolerance=uneven_tolerance
        )
        self._console = Console(highlight=False, soft_wrap=True)

    @property
    def rows(self) -> list[PhaseMemory]:
        return self.probe.rows

    @property
    def setup_lines(self) -> list[str]:
        return self.probe.lines + self.probe.rank_lines

    @property
    def warnings(self) -> list[str]:
        return self.probe.warnings

    # ------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        strategy = cfg.trainer.strategy
        setup = Setup(
            rank=trainer.info.rank,
            world_size=trainer.info.world_size,
            strategy=f"{strategy.name} ({strategy.sharding_strategy})",
            precision=cfg.trainer.precision,
            mixed_precision=trainer.policies.mixed_precision,
            wrap=trainer.policies.wrap,
            checkpointing=trainer.policies.checkpointing,
            state_dict_type=strategy.state_dict_type,
        )
        self.probe.describe(trainer.model, setup, first_step=trainer.start_step)
        for line in self.setup_lines:
            log.info("diagnostics: %s", line)
        for warning in self.warnings:
            log.warning("%s", warning)
        if trainer.is_rank0:
            self._console.print("[bold]diagnostics[/]")
            for line in self.setup_lines:
                self._console.print("  " + escape(line))

    # ------------------------------------------------------------------ per-phase memory
    def _mark(self, trainer: Trainer, step: int, phase: str) -> None:
        row = self.probe.mark(trainer.model, step, phase, optimizer=trainer.optimizer, device=trainer.device)
        if row is not None and phase == "batch_end" and self.probe.window_closes(step):
            self._log_memory_table(trainer)

    def on_train_batch_start(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "batch_start")
        if step == trainer.start_step + 1:  # itemize the first step's collectives
            self.probe.start_counting(trainer.model)

    def on_after_backward(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "after_backward")

    def on_before_optimizer_step(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "before_optimizer_step")
        for line in self.probe.stop_counting():
            log.info("diagnostics: %s", line)

    def on_train_batch_end(self, trainer: Trainer, step: int) -> None:
        self._mark(trainer, step, "batch_end")  # right after the step (on_step_end waits for the read)

    def on_fit_end(self, trainer: Trainer, summary: Summary) -> None:
        if self.rows and len(self.rows) < 4 * self.memory_steps:  # the run was shorter than the window
            self._log_memory_table(trainer)

    def _log_memory_table(self, trainer: Trainer) -> None:
        for line in self.probe.memory_lines():
            log.info("diagnostics: %s", line)
        if trainer.is_rank0:
            self.probe.write_memory_csv(attempt_path(trainer.run_dir, MEMORY_PHASES_FILE))
