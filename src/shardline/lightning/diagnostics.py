"""``DiagnosticsCallback``: ``shardline train``'s diagnostics for ``lightning.Trainer``, logged to its loggers.

``Trainer(strategy=ShardlineStrategy(...), callbacks=[DiagnosticsCallback()])``. At fit start every
rank describes what was resolved (units, reshard policy, mixed precision next to
``Trainer(precision=...)``, what the wrap and activation-checkpointing policies matched, the
checkpoint state-dict kind) and its own share of the parameters, with warnings; during the first
``memory_steps`` optimizer steps it records memory at four points of each (``batch_start``,
``after_backward``, ``before_optimizer_step``, ``batch_end``) and itemizes the first step's
collectives -- the same lines ``shardline train`` prints, from the same code
(:class:`shardline.diagnostics.probe.DiagnosticsProbe`).

Rank 0 sends them to each of the trainer's loggers: the memory rows as metrics
(``diagnostics/peak_rss_mib/after_backward``... at each step; every logger takes those), and the
text as ``diagnostics.txt`` -- an artifact of an ``MLFlowLogger``'s run, a text entry of a
``TensorBoardLogger`` (``diagnostics``), a summary entry of a ``WandbLogger`` run -- and writes
``diagnostics.txt`` and ``memory_phases.csv`` into ``trainer.log_dir`` (or ``default_root_dir``).

Note: with Lightning's own strategies (FSDP, DDP) there are no shardline units; the unit lines are
left out and the rest (precision, policies as given, per-rank share, memory) still applies.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl
import torch

from shardline.diagnostics.probe import DIAGNOSTICS_FILE, DiagnosticsProbe, Setup, policies_from_model

__all__ = ["DIAGNOSTICS_FILE", "DiagnosticsCallback"]

log = logging.getLogger("shardline.lightning")

MEMORY_FILE = "memory_phases.csv"


def _setup(trainer: pl.Trainer, model: torch.nn.Module) -> Setup:
    strategy = trainer.strategy
    derived_wrap, derived_checkpointing = policies_from_model(model)
    sharding = getattr(strategy, "sharding_strategy", None)
    name = getattr(strategy, "strategy_name", None) or type(strategy).__name__
    return Setup(
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        strategy=f"{name} ({getattr(sharding, 'value', sharding)})" if sharding is not None else str(name),
        precision=str(trainer.precision),
        mixed_precision=getattr(strategy, "mixed_precision", None),
        wrap=getattr(strategy, "auto_wrap_policy", None) or derived_wrap,
        checkpointing=getattr(strategy, "activation_checkpointing_policy", None) or derived_checkpointing,
        state_dict_type=str(getattr(strategy, "state_dict_type", "lightning")),
    )


class DiagnosticsCallback(pl.Callback):
    """See the module docstring.

    Args:
        memory_steps: How many optimizer steps memory is recorded for.
        dominant_unit_fraction: Warn when one unit holds more than this share of the parameters.
        uneven_tolerance: Warn when a rank holds more than this much above or below its even share.
    """

    def __init__(
        self, *, memory_steps: int = 3, dominant_unit_fraction: float = 0.5, uneven_tolerance: float = 0.25
    ) -> None:
        self.probe = DiagnosticsProbe(
            memory_steps=memory_steps, dominant_unit_fraction=dominant_unit_fraction, uneven_tolerance=uneven_tolerance
        )
        self._done = False

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = self._model(trainer, pl_module)
        self.probe.describe(model, _setup(trainer, model), first_step=trainer.global_step)
        for line in self.probe.lines + self.probe.rank_lines:
            log.info("diagnostics: %s", line)
        for warning in self.probe.warnings:
            log.warning("%s", warning)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        step = trainer.global_step + 1
        self._mark(trainer, pl_module, step, "batch_start")
        if step == self.probe.first_step + 1:
            self.probe.start_counting(self._model(trainer, pl_module))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, pl_module, trainer.global_step + 1, "after_backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._mark(trainer, pl_module, trainer.global_step + 1, "before_optimizer_step")
        for line in self.probe.stop_counting():
            log.info("diagnostics: %s", line)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step  # the optimizer step just taken
        self._mark(trainer, pl_module, step, "batch_end")
        if self.probe.window_closes(step):
            self._emit(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(trainer)  # a run shorter than the window

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _model(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.nn.Module:
        model = trainer.strategy.model
        return model if isinstance(model, torch.nn.Module) else pl_module

    def _mark(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, phase: str) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        row = self.probe.mark(
            self._model(trainer, pl_module), step, phase, optimizer=optimizer, device=pl_module.device
        )
        if row is not None and trainer.is_global_zero:
            metrics = self.probe.memory_metrics(row)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _emit(self, trainer: pl.Trainer) -> None:
        if self._done:
            return
        self._done = True
        for line in self.probe.memory_lines():
            log.info("diagnostics: %s", line)
        if not trainer.is_global_zero:
            return
        text = self.probe.text()
        folder = trainer.log_dir or trainer.default_root_dir
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, DIAGNOSTICS_FILE), "w", encoding="utf-8") as f:
            f.write(text)
        self.probe.write_memory_csv(os.path.join(folder, MEMORY_FILE))
        for logger in trainer.loggers:
            _log_text(logger, text)
            logger.save()


def _log_text(logger: Any, text: str) -> None:
    """``text`` where ``logger``'s UI shows it (MLflow artifact, TensorBoard text, W&B summary); others skip it."""
    kind = type(logger).__name__
    if kind == "MLFlowLogger":
        logger.experiment.log_text(logger.run_id, text, DIAGNOSTICS_FILE)
    elif kind == "TensorBoardLogger":
        logger.experiment.add_text("diagnostics", "```\n" + text + "```", 0)
    elif kind == "WandbLogger":
        logger.experiment.summary["diagnostics"] = text
