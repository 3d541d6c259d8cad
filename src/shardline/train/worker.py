"""What every training process runs: join the group, log to its own file, build the trainer, fit.

Every worker receives the typed :class:`~shardline.train.schema.TrainConfig` the launcher
checked (pickled by torch's launcher for the workers it starts; passed as is under torchrun and
with ``trainer.devices=1``).

Also the run directory's setup, shared by the local launcher and torchrun's rank 0:
:func:`open_run_dir` picks the directory, takes its lock (one run per directory, see
:mod:`.runlock`), checks what a resume will load (:mod:`.preflight`) and records the config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.lifecycle.manager import RESUME_AUTO, is_auto_resume, no_resume
from shardline.distributed import init_distributed
from shardline.errors import ConfigurationError
from shardline.train.build import build_callbacks, build_policies
from shardline.train.checkpointing import find_resumable_run
from shardline.train.config import resolve_accelerator, to_yaml
from shardline.train.launcher_channel import LauncherChannel, is_collective_timeout, stall_grace_s
from shardline.train.parentwatch import bind_to_parent
from shardline.train.preemption import PREEMPTED, Preempted
from shardline.train.preflight import check_resume
from shardline.train.records import CONFIG_FILE, LOGS_DIR, attempt_path
from shardline.train.runlock import RunLock
from shardline.train.schema import TrainConfig
from shardline.train.trainer import Trainer

__all__ = ["elastic_entry", "open_run_dir", "resolve_run_dir", "run_worker"]

log = logging.getLogger("shardline.train")


def resolve_run_dir(cfg: TrainConfig, experiment: str) -> Path:
    """Which run directory this run uses (nothing is created here).

    New runs go to ``<run_root>/<experiment>/<timestamp>`` or ``trainer.run_dir``. With
    ``trainer.resume=auto`` the run continues in ``trainer.run_dir`` or, without one, in the newest
    run of the experiment that has a committed checkpoint.

    Raises:
        ConfigurationError: ``trainer.run_dir`` is a file, or already holds files and the run is
            not resuming (nothing there is ever overwritten).
    """
    explicit = cfg.trainer.run_dir
    resuming = is_auto_resume(cfg.trainer.resume)
    if explicit:
        path = Path(str(explicit))
        if path.exists() and not path.is_dir():
            raise ConfigurationError(f"trainer.run_dir={path} is a file, not a directory; choose a directory path")
        if path.is_dir() and any(path.iterdir()) and not resuming:
            raise ConfigurationError(
                f"trainer.run_dir={path} already contains files; choose a new directory (runs never overwrite), "
                "or pass trainer.resume=auto to continue that run"
            )
        return path
    found = (
        find_resumable_run(Path(cfg.trainer.run_root), experiment, checkpoint_dir=str(cfg.checkpoint.dir or ""))
        if resuming
        else None
    )
    base = Path(cfg.trainer.run_root) / experiment / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = found or base, 1
    while found is None and path.exists():
        path = base.with_name(f"{base.name}-{n}")
        n += 1
    return path


def open_run_dir(cfg: TrainConfig, experiment: str) -> tuple[Path, RunLock]:
    """Create the run directory, take its lock, check the resume, record the config; returns (path, held lock).

    The caller releases the lock when the run ends. A stale lock (left by a run that died) is
    taken over; ``lock.stale`` names its holder for the caller to report.

    Raises:
        ConfigurationError: the directory cannot be created or written, or the resume does not fit.
        RunLockedError: another run holds the directory (the message names it).
    """
    path = resolve_run_dir(cfg, experiment)
    created = not path.exists()
    try:
        (path / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    lock = RunLock(path)
    try:
        lock.acquire()
        check_resume(cfg, path)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
        _record_config(path, cfg)
    except OSError as exc:
        lock.release()
        raise _unwritable(path, exc) from None
    except BaseException:
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                (path / LOGS_DIR).rmdir()
                path.rmdir()
        raise
    return path, lock


def _unwritable(path: Path, exc: OSError) -> ConfigurationError:
    return ConfigurationError(
        f"cannot create the run directory {path}: {exc.strerror or exc}. Set trainer.run_root (or "
        "trainer.run_dir) to a writable location."
    )


def _record_config(path: Path, cfg: TrainConfig) -> None:
    """``config.yaml``; a resumed attempt adds ``config.resume-N.yaml`` instead of replacing it."""
    attempt_path(path, CONFIG_FILE).write_text(to_yaml(cfg))


def _agree_on_run_dir(run_dir: str | None, cfg: TrainConfig, experiment: str, locks: list[RunLock]) -> Path:
    """Under torchrun no parent made the run directory: rank 0 opens it (and holds its lock) and tells the others."""
    if run_dir is None:

        def open_here() -> str:
            path, lock = open_run_dir(cfg, experiment)
            locks.append(lock)
            if lock.stale is not None:
                log.warning("took over the stale lock of %s, left by %s", path, lock.stale.describe())
            return str(path)

        run_dir = coord.rank0_decides(open_here, None)
    path = Path(run_dir)
    (path / LOGS_DIR).mkdir(parents=True, exist_ok=True)  # other nodes may not share the filesystem
    return path


def _resume_on_elastic_restart(cfg: TrainConfig, world_size: int) -> tuple[TrainConfig, int]:
    """``trainer.resume=auto`` is implied when torchrun restarted any rank's workers (a collective).

    Returns the config to run and the restart count (0: not a restart, or resume was set).

    torchrun counts restarts per agent (``TORCHELASTIC_RESTART_COUNT``): a node that joins starts
    at 0 while the survivors are past it, so the ranks agree -- any restart means the job resumes.
    """
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if count is None or not no_resume(cfg.trainer.resume):
        return cfg, 0
    mine = int(count) if count.isdigit() else 0
    restart = coord.max_over_ranks(mine, None) if world_size > 1 else mine
    if restart == 0:
        return cfg, 0
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=RESUME_AUTO)), restart


def _setup_logging(run_dir: Path, rank: int) -> None:
    # A full disk must not turn every log call into a printed traceback: the failure that matters is
    # reported once, through the launcher.
    logging.raiseExceptions = False
    handler = logging.FileHandler(run_dir / LOGS_DIR / f"rank{rank}.log")
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


def run_worker(cfg: TrainConfig, *, run_dir: str | None, experiment: str) -> dict[str, Any] | None:
    """Train on this process as one rank of the job; returns the summary on rank 0.

    Raises:
        ConfigurationError: ``cfg`` is not a :class:`TrainConfig` (see :func:`~shardline.train.config.to_train_config`).
    """
    if not isinstance(cfg, TrainConfig):
        raise ConfigurationError(
            f"a worker needs a TrainConfig (shardline.train.config.to_train_config), got {type(cfg).__name__}"
        )
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    owns_group = not dist.is_initialized()
    info = init_distributed(
        backend="nccl" if accelerator == "cuda" else "gloo", timeout=cfg.trainer.collective_timeout_s
    )
    locks: list[RunLock] = []
    try:
        cfg, restart = _resume_on_elastic_restart(cfg, info.world_size)
        path = _agree_on_run_dir(run_dir, cfg, experiment, locks)
        _setup_logging(path, info.rank)
        if restart:
            log.info("elastic restart %d (torchrun): trainer.resume=auto is implied", restart)
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
        except Preempted as stop:
            log.warning("%s", stop)
            raise
        except BaseException:
            log.exception("training failed on rank %d", info.rank)
            raise
        log.info("done: %s", summary.to_dict())
        return summary.to_dict() if info.rank == 0 else None
    finally:
        for lock in locks:
            lock.release()
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


@record
def elastic_entry(
    config: TrainConfig,
    run_dir: str,
    experiment: str,
    channel_address: str | None = None,
    launcher_pid: int | None = None,
) -> dict[str, Any] | None:
    """Entry point of the workers the local launcher starts.

    The worker exits if the launcher (``launcher_pid``) dies (:mod:`.parentwatch`). Errors are
    recorded for torch's launcher (``@record``) and reported to shardline's launcher over
    ``channel_address`` (see :mod:`.launcher_channel`): a collective timeout lingers briefly so that every
    rank that waited reports, and the launcher can name the rank that did not. A preemption
    (:mod:`.preemption`) is a clean return, which the launcher reads.
    """
    bind_to_parent(parent_pid=launcher_pid)
    channel = None
    if channel_address:
        try:
            channel = LauncherChannel(channel_address, int(os.environ.get("RANK", "0")))
        except OSError:
            channel = None
    clean = False
    try:
        result = run_worker(config, run_dir=run_dir, experiment=experiment)
        clean = True
        return result
    except Preempted as stop:  # a clean stop: the launcher reads it from the return value (or the report)
        clean = True
        if channel is not None:
            channel.preempted(str(stop))
        return {PREEMPTED: stop.step, "checkpoint": stop.checkpoint, "message": str(stop)}
    except BaseException as error:
        if channel is not None:
            channel.failed(error)
            if is_collective_timeout(error):
                time.sleep(stall_grace_s(config.trainer.collective_timeout_s))
        raise
    finally:
        if channel is not None:
            channel.close(clean=clean)
