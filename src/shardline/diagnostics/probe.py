"""The diagnostics of one training run, for any front end: ``shardline train``, Lightning, HF Trainer.

A :class:`DiagnosticsProbe` is driven by a front end's hooks: :meth:`~DiagnosticsProbe.describe`
at fit start (what was resolved: units, precision, policies, state-dict kind, this rank's
share, with warnings), :meth:`~DiagnosticsProbe.mark` at the points of each of the first steps
(memory per phase), :meth:`~DiagnosticsProbe.start_counting` /
:meth:`~DiagnosticsProbe.stop_counting` around the first step (its collectives). It holds what
it found as lines of text, rows and numbers; each front end prints, writes and sends them to
its tracker (``shardline.train.diagnostics``, ``shardline.lightning.diagnostics``,
``shardline.hf.diagnostics``), so the three show the same diagnostics from one implementation.
"""

from __future__ import annotations

import contextlib
import csv
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

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
from shardline.engine import (
    CommCounter,
    MixedPrecision,
    count_collectives,
    is_checkpointed,
    layer_policy,
    memory_stats,
    original_class,
    reset_peak_memory_stats,
    subtree_units,
)

__all__ = ["DIAGNOSTICS_FILE", "MEMORY_COLUMNS", "DiagnosticsProbe", "Setup", "policies_from_model"]

DIAGNOSTICS_FILE = "diagnostics.txt"
"""What a tracker's copy of :meth:`DiagnosticsProbe.text` is named."""

MEMORY_COLUMNS = ("step", "phase", "engine_mib", "engine_peak_mib", "peak_rss_mib", "cuda_peak_mib")
"""The columns of ``memory_phases.csv``."""

Policy = Callable[[nn.Module], bool]


@dataclass(frozen=True)
class Setup:
    """What a front end resolved, as the diagnostics describe it."""

    rank: int
    world_size: int
    strategy: str
    """How the strategy is named to the user, e.g. ``fsdp (full_shard)``."""
    precision: str
    """The autocast setting in ``trainer.precision``'s words: ``bf16-mixed``, ``32-true``..."""
    mixed_precision: MixedPrecision | None
    wrap: Policy | None
    checkpointing: Policy | None
    state_dict_type: str


def policies_from_model(model: nn.Module) -> tuple[Policy | None, Policy | None]:
    """``(wrap, checkpointing)`` policies as the sharded ``model`` shows them: ``layer_policy`` of the classes that
    became units, and of those that recompute activations (None where there are none).

    Note: for front ends that resolve the policies inside their own constructor and keep no handle on them (HF
    Trainer); the classes are those the resolved policies matched, so the description is the same.
    """
    units = [u for u in subtree_units(model) if not u.is_root]
    wrapped = sorted({original_class(u.module) for u in units}, key=lambda c: c.__name__)
    checkpointed = sorted({type(m) for m in model.modules() if is_checkpointed(m)}, key=lambda c: c.__name__)
    return (layer_policy(*wrapped) if wrapped else None, layer_policy(*checkpointed) if checkpointed else None)


class DiagnosticsProbe:
    """See the module docstring. Thresholds as ``callbacks.diagnostics`` of ``shardline train`` has them."""

    def __init__(
        self, *, memory_steps: int = 3, dominant_unit_fraction: float = 0.5, uneven_tolerance: float = 0.25
    ) -> None:
        self.memory_steps = memory_steps
        self.dominant_unit_fraction = dominant_unit_fraction
        self.uneven_tolerance = uneven_tolerance
        self.lines: list[str] = []
        """What was resolved (the same on every rank)."""
        self.rank_lines: list[str] = []
        """This rank's share."""
        self.warnings: list[str] = []
        self.rows: list[PhaseMemory] = []
        self.comm_lines: list[str] = []
        self.first_step = 0
        self._counter: CommCounter | None = None
        self._counting: contextlib.AbstractContextManager[CommCounter] | None = None

    # ------------------------------------------------------------------ setup
    def describe(self, model: nn.Module, setup: Setup, *, first_step: int = 0) -> None:
        """Describe the sharded ``model`` as ``setup`` resolved it; memory is measured for the steps after
        ``first_step`` (the step training starts from)."""
        units = subtree_units(model)
        lines = [f"strategy {setup.strategy}, world size {setup.world_size}"]
        if units:
            lines += unit_summary(units, setup.world_size)
        precision_lines, precision_warnings = precision_summary(setup.precision, setup.mixed_precision)
        lines += precision_lines
        lines += policy_summary(model, units, setup.wrap, setup.checkpointing)
        lines.append(f"checkpoint state-dict kind: {setup.state_dict_type}")
        rank_lines, rank_warnings = rank_summary(
            setup.rank,
            setup.world_size,
            model,
            units,
            dominant_fraction=self.dominant_unit_fraction,
            uneven_tolerance=self.uneven_tolerance,
        )
        self.lines, self.rank_lines = lines, rank_lines
        self.warnings = precision_warnings + rank_warnings
        self.first_step = first_step
        reset_peak_memory_stats(model)
        reset_peak_rss()

    # ------------------------------------------------------------------ per-phase memory
    def in_window(self, step: int) -> bool:
        """Whether ``step`` is one of the first ``memory_steps`` steps measured."""
        return self.first_step < step <= self.first_step + self.memory_steps

    def window_closes(self, step: int) -> bool:
        """Whether ``step`` is the last step measured (its ``batch_end`` completes the table)."""
        return step == self.first_step + self.memory_steps

    def mark(
        self, model: nn.Module, step: int, phase: str, *, optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> PhaseMemory | None:
        """Record memory at the end of ``phase`` of ``step`` (and its peak during the phase); None outside the
        window."""
        if not self.in_window(step):
            return None
        stats = memory_stats(model, optimizer=optimizer)
        measured = stats.sharded_params + stats.sharded_grads + stats.optimizer_state + stats.unsharded_grads
        cuda = None
        if device.type == "cuda":
            cuda = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        row = PhaseMemory(
            step=step,
            phase=phase,
            engine_bytes=stats.total,
            engine_peak_bytes=measured + stats.peak_unsharded_params + stats.peak_comm_buffers,
            peak_rss_bytes=peak_rss_bytes(),
            cuda_peak_bytes=cuda,
        )
        self.rows.append(row)
        reset_peak_memory_stats(model)
        reset_peak_rss()
        return row

    def memory_lines(self) -> list[str]:
        """The per-phase table as text."""
        return [
            "memory per phase (peak = during the phase that ends at this point)",
            *(row.line() for row in self.rows),
        ]

    def memory_metrics(self, row: PhaseMemory) -> dict[str, float]:
        """One row as tracker metrics: ``diagnostics/<quantity>_mib/<phase>``."""
        values = {
            "engine_mib": row.engine_bytes,
            "engine_peak_mib": row.engine_peak_bytes,
            "peak_rss_mib": row.peak_rss_bytes,
            "cuda_peak_mib": row.cuda_peak_bytes,
        }
        return {f"diagnostics/{k}/{row.phase}": v / 2**20 for k, v in values.items() if v is not None}

    def write_memory_csv(self, path: str | os.PathLike[str]) -> None:
        """``memory_phases.csv``: one row per phase of the measured steps, in MiB."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(MEMORY_COLUMNS)
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

    # ------------------------------------------------------------------ collectives of the first step
    def start_counting(self, model: nn.Module) -> None:
        """Count the collectives from here to :meth:`stop_counting` (the first step's)."""
        if self._counting is None and not self.comm_lines:
            self._counting = count_collectives(model)
            self._counter = self._counting.__enter__()

    def stop_counting(self) -> list[str]:
        """Stop counting; the collectives counted, by kind, unit and phase (empty if none was counting)."""
        if self._counting is None or self._counter is None:
            return []
        self._counting.__exit__(None, None, None)
        self._counting = None
        self.comm_lines = comm_table(self._counter.records)
        return self.comm_lines

    # ------------------------------------------------------------------ all of it
    def text(self) -> str:
        """Everything found so far, as the text a tracker shows (``diagnostics.txt``)."""
        parts = [
            *self.lines,
            *self.rank_lines,
            *(f"warning: {w}" for w in self.warnings),
            *self.comm_lines,
            *(self.memory_lines() if self.rows else []),
        ]
        return "\n".join(parts) + "\n"
