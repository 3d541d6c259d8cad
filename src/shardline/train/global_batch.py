"""The global batch of a run: fixed once, and the accumulation steps re-derived at every world size.

A run's global batch -- sequences per optimizer step, over all ranks -- is decided at its first
start: ``trainer.global_batch_size`` when set, else ``micro_batch_size x accumulate_grad_batches
x world size``. Every checkpoint records it (the trainer state's ``data.global_batch``), and a
resume keeps it whatever the world size has become: the accumulation steps are re-derived so
that ``micro_batch_size x accumulation x world size`` equals it again. Together with a sample
stream defined globally (:mod:`shardline.train.data.batches`), a step then trains on the same
samples at any world size, so its loss is the same mean up to the order of the reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.errors import ConfigurationError

__all__ = ["BatchPlan", "plan_global_batch"]


@dataclass(frozen=True)
class BatchPlan:
    """How one step's global batch is cut at this world size."""

    global_batch: int
    """Sequences per optimizer step, over all ranks (invariant for the run)."""
    micro_batch: int
    """Sequences per rank per forward/backward."""
    accumulate: int
    """Micro-batches per rank per optimizer step."""
    world_size: int

    @property
    def local_batch(self) -> int:
        """Sequences per rank per optimizer step."""
        return self.micro_batch * self.accumulate


def plan_global_batch(
    *, micro_batch: int, accumulate: int, world_size: int, configured: int = 0, recorded: int | None = None
) -> BatchPlan:
    """The batch plan at ``world_size``.

    Args:
        micro_batch: ``trainer.micro_batch_size``.
        accumulate: ``trainer.accumulate_grad_batches`` (used only when nothing fixes the global batch).
        world_size: Ranks of this attempt.
        configured: ``trainer.global_batch_size`` (0 or less: not set).
        recorded: The global batch a resumed checkpoint recorded (None: a first start, or a
            checkpoint written before global batches were recorded).

    Raises:
        ConfigurationError: the configured global batch contradicts the recorded one, or the
            global batch is not a multiple of ``micro_batch x world_size`` (one line naming the
            three numbers and what to change).
    """
    if micro_batch < 1 or accumulate < 1 or world_size < 1:
        raise ConfigurationError(
            f"trainer.micro_batch_size={micro_batch}, trainer.accumulate_grad_batches={accumulate} and the world "
            f"size {world_size} must all be at least 1"
        )
    if recorded is not None and configured > 0 and configured != recorded:
        raise ConfigurationError(
            f"trainer.global_batch_size={configured}, but the checkpoint being resumed was trained with a global "
            f"batch of {recorded}; a resumed run keeps its global batch. Drop the override (or set it to {recorded}), "
            "or start a new run without resuming."
        )
    if recorded is not None:
        target, why = recorded, "the run's global batch (recorded in its checkpoint)"
    elif configured > 0:
        target, why = configured, "trainer.global_batch_size"
    else:
        return BatchPlan(micro_batch * accumulate * world_size, micro_batch, accumulate, world_size)
    per_step = micro_batch * world_size
    if target % per_step:
        fits = [w for w in range(1, target + 1) if target % (micro_batch * w) == 0]
        options = [f"run on a world size in {fits[:8]}"] if fits else []
        if target % world_size == 0:  # each rank's share is whole: a micro-batch dividing it fits
            options.append(f"use a trainer.micro_batch_size that divides {target // world_size}")
        frozen = "; a resumed run keeps its global batch" if recorded is not None else ""
        raise ConfigurationError(
            f"{why} is {target} sequences, which micro-batches of {micro_batch} (trainer.micro_batch_size) on "
            f"{world_size} ranks cannot divide ({target} is not a multiple of {micro_batch} x {world_size}{frozen}). "
            f"To continue, {' or '.join(options)}"
        )
    return BatchPlan(target, micro_batch, target // per_step, world_size)
