"""What every training process runs: join the group, log to its own file, build the trainer, fit."""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from shardline.distributed import DistInfo, init_distributed
from shardline.errors import ConfigurationError
from shardline.train.build import build_callbacks, build_policies
from shardline.train.checkpointing import find_resumable_run
from shardline.train.config import resolve_accelerator, to_yaml
from shardline.train.trainer import Trainer

__all__ = ["elastic_entry", "make_run_dir", "run_worker"]

log = logging.getLogger("shardline.train")


def make_run_dir(cfg: DictConfig, experiment: str) -> Path:
    """Create (or, for ``trainer.resume=auto``, find) the run directory and record the config in it.

    New runs go to ``<run_root>/<experiment>/<timestamp>`` or ``trainer.run_dir``. With
    ``trainer.resume=auto`` the run continues in ``trainer.run_dir`` or, without one, in the newest
    run of the experiment that has a committed checkpoint. Raises ConfigurationError if the
    directory cannot be created or written, or if an explicit ``trainer.run_dir`` already holds
    files and the run is not resuming (nothing there is ever overwritten).
    """
    explicit = cfg.trainer.run_dir
    resuming = str(cfg.trainer.resume) == "auto"
    if explicit:
        path = Path(str(explicit))
        if path.exists() and any(path.iterdir()) and not resuming:
            raise ConfigurationError(
                f"trainer.run_dir={path} already contains files; choose a new directory (runs never overwrite), "
                "or pass trainer.resume=auto to continue that run"
            )
    else:
        found = find_resumable_run(Path(cfg.trainer.run_root), experiment) if resuming else None
        base = Path(cfg.trainer.run_root) / experiment / datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = found or base, 1
        while found is None and path.exists():
            path = base.with_name(f"{base.name}-{n}")
            n += 1
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
        _record_config(path, cfg)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot create the run directory {path}: {exc.strerror or exc}. Set trainer.run_root (or "
            "trainer.run_dir) to a writable location."
        ) from None
    return path


def _record_config(path: Path, cfg: DictConfig) -> None:
    """``config.yaml``; a resumed attempt adds ``config.resume-N.yaml`` instead of replacing it."""
    target, n = path / "config.yaml", 1
    while target.exists():
        target = path / f"config.resume-{n}.yaml"
        n += 1
    target.write_text(to_yaml(cfg))


def _agree_on_run_dir(run_dir: str | None, cfg: DictConfig, experiment: str, info: DistInfo) -> Path:
    """Under torchrun no parent made the run directory: rank 0 makes it and tells the others."""
    if run_dir is None:
        box = [str(make_run_dir(cfg, experiment)) if info.rank == 0 else None]
        if info.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        run_dir = box[0]
    path = Path(run_dir)
    (path / "logs").mkdir(parents=True, exist_ok=True)  # other nodes may not share the filesystem
    return path


def _setup_logging(run_dir: Path, rank: int) -> None:
    handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("shardline")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("shardline: %(levelname)s: %(message)s"))
        # Failures reach the terminal once, through the launcher; their tracebacks go to the log file.
        console.addFilter(lambda record: record.exc_info is None)
        root.addHandler(console)


def run_worker(config: dict[str, Any], *, run_dir: str | None, experiment: str) -> dict[str, Any] | None:
    """Train on this process as one rank of the job; returns the summary on rank 0."""
    cfg = OmegaConf.create(config)
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    owns_group = not dist.is_initialized()
    info = init_distributed(
        backend="nccl" if accelerator == "cuda" else "gloo", timeout=cfg.trainer.collective_timeout_s
    )
    try:
        path = _agree_on_run_dir(run_dir, cfg, experiment, info)
        _setup_logging(path, info.rank)
        log.info("rank %d of %d on %s (%s)", info.rank, info.world_size, info.device, info.backend)
        try:
            trainer = Trainer(
                cfg,
                info=info,
                run_dir=path,
                experiment=experiment,
                policies=build_policies(cfg),
                callbacks=build_callbacks(cfg),
            )
            summary = trainer.fit()
        except BaseException:
            log.exception("training failed on rank %d", info.rank)
            raise
        log.info("done: %s", summary.to_dict())
        return summary.to_dict() if info.rank == 0 else None
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


@record
def elastic_entry(config: dict[str, Any], run_dir: str, experiment: str) -> dict[str, Any] | None:
    """Entry point of the workers the local launcher starts (errors are recorded for the parent)."""
    return run_worker(config, run_dir=run_dir, experiment=experiment)
