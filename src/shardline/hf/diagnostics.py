"""``DiagnosticsCallback``: ``shardline train``'s diagnostics for a Hugging Face ``Trainer``, logged to the
trackers ``report_to`` started.

``ShardlineTrainer(..., callbacks=[DiagnosticsCallback()])``. At ``on_train_begin`` every rank
describes what was resolved (units, reshard policy, the mixed precision applied next to
``bf16=``/``fp16=``, the classes the wrap and activation-checkpointing policies matched, the
checkpoint state-dict kind) and its own share of the parameters, with warnings; during the first
``memory_steps`` optimizer steps it records memory at three points of each (``batch_start`` at
``on_step_begin``, ``before_optimizer_step`` at ``on_pre_optimizer_step`` -- after backward of
every micro-batch, Trainer has no hook between backward and clipping -- and ``batch_end`` at
``on_step_end``) and itemizes the first step's collectives: the same lines ``shardline train``
prints, from the same code (:class:`shardline.diagnostics.probe.DiagnosticsProbe`).

Rank 0 writes ``diagnostics.txt`` and ``memory_phases.csv`` into ``args.output_dir`` and sends
them to the trackers ``report_to`` runs: the active MLflow run gets the text as the artifact
``diagnostics.txt`` and the memory rows as metrics (``diagnostics/peak_rss_mib/before_optimizer_step``...
at each step), the active W&B run the text and the latest numbers as summary entries (its history
steps are Trainer's own).

Note: Trainer hands a callback no handle on its integrations, so this finds their runs the way
they expose them (``mlflow.active_run()``, ``wandb.run``). Trainer adds its integration callbacks
before the user's, so their runs are open by the time this one's ``on_train_begin`` runs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from shardline.diagnostics.probe import DIAGNOSTICS_FILE, DiagnosticsProbe, Setup, policies_from_model
from shardline.diagnostics.summaries import PhaseMemory
from shardline.engine import subtree_units
from shardline.hf.tracking import active as _active

__all__ = ["DIAGNOSTICS_FILE", "DiagnosticsCallback"]

log = logging.getLogger("shardline.hf")

MEMORY_FILE = "memory_phases.csv"


def _precision(args: TrainingArguments) -> str:
    return "bf16-mixed" if args.bf16 else ("16-mixed" if args.fp16 else "32-true")


def _setup(args: TrainingArguments, model: torch.nn.Module) -> Setup:
    units = subtree_units(model)
    root = next((u for u in units if u.is_root), units[-1] if units else None)
    wrap, checkpointing = policies_from_model(model)
    strategy = root.strategy.value if root is not None else "not sharded by shardline"
    return Setup(
        rank=args.process_index,
        world_size=args.world_size,
        strategy=f"ShardlineTrainer ({strategy})",
        precision=_precision(args),
        mixed_precision=root.mixed_precision if root is not None else None,
        wrap=wrap,
        checkpointing=checkpointing,
        state_dict_type="sharded",
    )


class DiagnosticsCallback(TrainerCallback):
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
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._done = False

    # ------------------------------------------------------------------ hooks
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not isinstance(model, torch.nn.Module):
            return
        self._model, self._optimizer = model, kwargs.get("optimizer")
        self.probe.describe(model, _setup(args, model), first_step=state.global_step)
        for line in self.probe.lines + self.probe.rank_lines:
            log.info("diagnostics: %s", line)
        for warning in self.probe.warnings:
            log.warning("%s", warning)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        step = state.global_step + 1
        self._mark(args, step, "batch_start")
        if self._model is not None and step == self.probe.first_step + 1:
            self.probe.start_counting(self._model)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._mark(args, state.global_step + 1, "before_optimizer_step")
        for line in self.probe.stop_counting():
            log.info("diagnostics: %s", line)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._mark(args, state.global_step, "batch_end")  # global_step counts the step just taken
        if self.probe.window_closes(state.global_step):
            self._emit(args)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._emit(args)  # a run shorter than the window

    # ------------------------------------------------------------------ helpers
    def _mark(self, args: TrainingArguments, step: int, phase: str) -> None:
        if self._model is None:
            return
        optimizer = getattr(self._optimizer, "optimizer", self._optimizer)  # Accelerate wraps it
        row = self.probe.mark(self._model, step, phase, optimizer=optimizer, device=args.device)
        if row is not None and args.process_index == 0:
            _log_metrics(self.probe, row, step)

    def _emit(self, args: TrainingArguments) -> None:
        if self._done or self._model is None:
            return
        self._done = True
        for line in self.probe.memory_lines():
            log.info("diagnostics: %s", line)
        if args.process_index != 0:
            return
        text = self.probe.text()
        folder = args.output_dir or "."
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, DIAGNOSTICS_FILE), "w", encoding="utf-8") as f:
            f.write(text)
        self.probe.write_memory_csv(os.path.join(folder, MEMORY_FILE))
        mlflow, wandb = _active("mlflow"), _active("wandb")
        if mlflow is not None:
            mlflow.log_text(text, DIAGNOSTICS_FILE)
        if wandb is not None:
            wandb.run.summary["diagnostics"] = text


def _log_metrics(probe: DiagnosticsProbe, row: PhaseMemory, step: int) -> None:
    metrics = probe.memory_metrics(row)
    mlflow, wandb = _active("mlflow"), _active("wandb")
    if mlflow is not None:
        mlflow.log_metrics(metrics, step=step)
    if wandb is not None:
        wandb.run.summary.update(metrics)  # history rows go through Trainer's own logging
