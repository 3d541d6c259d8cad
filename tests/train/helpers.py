"""Callbacks injected through the config (+callbacks.NAME._target_=...) to make a worker misbehave.

Most act in ``on_train_batch_end``, right after the step; ``on_step_end`` (with the step's read
metrics) only runs at the end of the read interval.
"""

from __future__ import annotations

import time
from typing import Any


class CrashOnRank:
    """Raise on one rank after a given step: the job must stop and show this error."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if trainer.info.rank == self.rank and step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class HangOnRank:
    """Stop participating on one rank (sleep) so its peers wait in a collective until the timeout."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if trainer.info.rank == self.rank and step == self.step:
            time.sleep(3600)


class PoisonWeights:
    """Overwrite every local shard with NaN after a step, on every rank: the next loss diverges everywhere.

    ``on_train_batch_end`` runs right after each step (``on_step_end`` only at the next read).
    """

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if step == self.step:
            import torch

            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.fill_(float("nan"))


class StopOnRank:
    """SIGSTOP one rank after a step (as a debugger, a swapped-out node or a frozen VM would), recording when."""

    def __init__(self, rank: int = 1, step: int = 2, record: str = "") -> None:
        self.rank, self.step, self.record = rank, step, record

    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if trainer.info.rank == self.rank and step == self.step:
            import os
            import signal

            with open(self.record, "w") as f:
                f.write(f"{os.getpid()} {time.time()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)


class DiskFullAt:
    """From a step on, every checkpoint write of one rank fails with ENOSPC, like a full disk."""

    def __init__(self, rank: int = 1, step: int = 3) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if step == self.step:
            from shardline.checkpoint.faults.fault import FailWrites

            trainer.checkpoints.manager.observer = FailWrites(ranks={self.rank}, after_bytes=1000)


class EmptyErrorFileThenExit:
    """Leave torch's elastic error file empty (as on a full disk) and die without a word, once the
    step's metrics row is written (``on_step_end``, at the read)."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, trainer: Any, metrics: Any) -> None:
        if trainer.info.rank == self.rank and metrics.step == self.step:
            import os

            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w"):
                pass
            os._exit(3)


class RecordConfigType:
    """Write, on every rank, the type of the config the worker was given and a few of its typed fields."""

    def __init__(self, folder: str = "") -> None:
        self.folder = folder

    def on_fit_start(self, trainer: Any) -> None:
        import json
        from pathlib import Path

        cfg = trainer.cfg
        record = {
            "config": f"{type(cfg).__module__}.{type(cfg).__qualname__}",
            "strategy": f"{type(cfg.trainer.strategy).__module__}.{type(cfg.trainer.strategy).__qualname__}",
            "sharding": repr(cfg.trainer.strategy.sharding),
            "max_steps": cfg.trainer.max_steps,
            "model": type(cfg.model).__name__,
        }
        Path(self.folder, f"rank{trainer.info.rank}.json").write_text(json.dumps(record))


class SlowCheckpointFiles:
    """Make every checkpoint manifest write in this worker take ``seconds`` longer (a slow file system)."""

    def __init__(self, seconds: float = 1.0) -> None:
        import importlib

        module = importlib.import_module("shardline.checkpoint.storage.local")
        real = module.write_unflushed  # each record file of a local commit (statement, manifest, hash files)

        def slow(path: Any, data: bytes) -> Any:
            time.sleep(seconds)
            return real(path, data)

        module.write_unflushed = slow


class RaiseEverywhere:
    """Raise the same error on every rank at the end of a step (after the previous saves were queued)."""

    def __init__(self, step: int = 3) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, metrics: Any) -> None:
        if metrics.step == self.step:
            raise RuntimeError(f"injected failure on every rank at step {self.step}")


class CrashOnStepEnd:
    """Raise on one rank in ``on_step_end`` of a step, after the callbacks before it recorded that step's metrics."""

    def __init__(self, rank: int = 0, step: int = 3) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, trainer: Any, metrics: Any) -> None:
        if trainer.info.rank == self.rank and metrics.step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} after step {self.step} was reported")


class SigtermAt:
    """Send SIGTERM to this worker as step ``step`` starts, as a preemption notice would arrive mid-step."""

    def __init__(self, rank: int = 1, step: int = 3, times: int = 1) -> None:
        self.rank, self.step, self.times = rank, step, times

    def on_train_batch_start(self, trainer: Any, step: int) -> None:
        if trainer.info.rank == self.rank and step == self.step:
            import os
            import signal

            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGTERM)


class RecordPid:
    """Write ``rank<N>.pid`` with this worker's pid into ``folder`` when training starts."""

    def __init__(self, folder: str = "") -> None:
        self.folder = folder

    def on_fit_start(self, trainer: Any) -> None:
        import os
        from pathlib import Path

        Path(self.folder, f"rank{trainer.info.rank}.pid").write_text(str(os.getpid()))


class HoldOnNode:
    """On the workers of one simulated node (``SHARDLINE_TEST_NODE`` in its agent's environment), hold at the
    start of ``step`` until ``FOLDER/NODE-STEP.release`` exists or a preemption signal arrives; writes
    ``FOLDER/NODE-STEP.reached`` first. Lets a test act while its peers wait in a collective."""

    def __init__(self, node: str = "", step: int = 5, folder: str = "") -> None:
        self.node, self.step, self.folder = node, step, folder

    def on_train_batch_start(self, trainer: Any, step: int) -> None:
        import os
        from pathlib import Path

        if os.environ.get("SHARDLINE_TEST_NODE") != self.node or step != self.step:
            return
        mark = Path(self.folder, f"{self.node}-{step}")
        mark.with_suffix(".reached").write_text(f"{os.getpid()} {trainer.info.world_size}")
        deadline = time.monotonic() + 150
        while not mark.with_suffix(".release").exists() and not trainer.preemption.requested:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mark} was never released")
            time.sleep(0.1)


class LingerOnPreemption:
    """Once a preemption signal arrived, make the step in flight take ``seconds`` longer on every rank (a long
    step or a slow save): the launcher must wait for it, up to ``trainer.preemption_grace_s``."""

    def __init__(self, seconds: float = 6.0) -> None:
        self.seconds, self.done = seconds, False

    def on_train_batch_end(self, trainer: Any, step: int) -> None:
        if trainer.preemption.requested and not self.done:
            self.done = True
            time.sleep(self.seconds)
