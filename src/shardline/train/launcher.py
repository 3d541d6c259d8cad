"""``shardline train``: compose, validate, then train here, under torchrun, or on N local workers.

Three ways to run, one code path per worker (:func:`shardline.train.worker.run_worker`):

* under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): this process is one rank; it joins the job;
* ``trainer.devices=1``: train in this process (a one-rank group);
* ``trainer.devices=N``: start N workers on this node with torch's elastic launcher (the
  machinery behind torchrun). Rank 0 keeps the terminal; the others log to files. If any worker
  fails, the launcher stops the rest at once and this command exits 1 showing that worker's
  error; a worker stuck in a collective fails after ``trainer.collective_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from shardline.distributed import free_port
from shardline.errors import ShardlineError
from shardline.train.build import preflight
from shardline.train.config import compose_config, experiment_name, to_yaml, validate
from shardline.train.worker import elastic_entry, make_run_dir, run_worker

__all__ = ["train"]

_FALLOUT = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "SignalException")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def train(overrides: Sequence[str], *, print_config: bool = False, config_dirs: Sequence[str] = ()) -> int:
    """Run ``shardline train`` with Hydra-style ``overrides``; returns the process exit code.

    ``config_dirs`` are ``--config-dir`` folders with more experiment/strategy YAML files.
    """
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        cfg = compose_config(overrides, config_dirs=config_dirs)
        if print_config:
            print(to_yaml(cfg), end="")
            return 0
        launched = _under_torchrun()
        validate(cfg, launched=launched)
        preflight(cfg)
        experiment = experiment_name(overrides)
        config = OmegaConf.to_container(cfg, resolve=True)
        if launched:
            run_worker(config, run_dir=None, experiment=experiment)
            return 0
        run_dir = make_run_dir(cfg, experiment)
    except ShardlineError as exc:
        err.print("[bold red]error:[/]", escape(str(exc)))
        return 2
    if cfg.trainer.devices == 1:
        try:
            run_worker(config, run_dir=str(run_dir), experiment=experiment)
        except Exception as exc:
            err.print("[bold red]error:[/] training failed:", escape(f"{type(exc).__name__}: {exc}"))
            err.print(traceback.format_exc().rstrip(), markup=False)
            err.print(f"log: {run_dir / 'logs' / 'rank0.log'}", markup=False)
            return 1
        return 0
    return _launch_local(cfg, config, run_dir, experiment, err)


def _launch_local(cfg: DictConfig, config: dict[str, Any], run_dir: Path, experiment: str, err: Console) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    devices = cfg.trainer.devices
    if cfg.trainer.accelerator != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // devices))
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=devices,
        run_id=f"shardline-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(
            log_dir=str(run_dir / "logs" / "workers"),
            redirects=dict.fromkeys(range(1, devices), Std.ALL),
        ),
    )
    quiet = logging.getLogger("torch.distributed.elastic")
    previous = quiet.level
    quiet.setLevel(logging.CRITICAL)  # we print the failing worker's error ourselves, once
    try:
        elastic_launch(launch, elastic_entry)(config, str(run_dir), experiment)
    except ChildFailedError as exc:
        rank, message, trace = _root_cause(exc)
        err.print("[bold red]error:[/]", escape(f"worker rank {rank} failed: {message}"))
        if trace:
            err.print(trace.rstrip(), markup=False, highlight=False)
        err.print(f"logs of every rank: {run_dir / 'logs'}", markup=False)
        return 1
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    finally:
        quiet.setLevel(previous)
    return 0


def _root_cause(exc: Any) -> tuple[int, str, str]:
    """The failure that caused the others: earliest, and not a peer noticing a dead rank."""
    failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
    real = [f for f in failures if not any(m in _failure_text(f[1]) for m in _FALLOUT)] or failures
    rank, failure = real[0]
    data = failure.error_file_data or {}
    message = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
    text = message.get("message") or str(failure.message) or f"exit code {failure.exitcode}"
    trace = message.get("extraInfo", {}).get("py_callstack", "")
    return failure.local_rank if hasattr(failure, "local_rank") else rank, text, trace


def _failure_text(failure: Any) -> str:
    data = failure.error_file_data or {}
    return f"{failure.message} {data}"
