"""``shardline train``: compose, validate, then train here, under torchrun, or on N local workers.

Three ways to run, one code path per worker (:func:`shardline.train.worker.run_worker`):

* under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): this process is one rank; it joins the job;
* ``trainer.devices=1``: train in this process (a one-rank group);
* ``trainer.devices=N``: start N workers on this node with torch's elastic launcher (the
  machinery behind torchrun). Rank 0 keeps the terminal; the others log to files. If any worker
  fails, the launcher stops the rest at once and this command exits 1 with one first line naming
  the cause (the failing rank, its exception's type and message; for a collective that timed
  out, the stalled rank(s) and ``trainer.collective_timeout_s``), then the worker's traceback.
  A SIGTERM to this command (or to its whole process group) is a preemption: every worker
  saves the step in flight and the command exits 143 (:mod:`.relay`).

Before any worker starts, everything that can be checked is (exit code 2, one line): the config
(:mod:`.config`), the model and policies on the meta device (:mod:`.build`), numbers and data
and the checkpoint a resume will load (:mod:`.preflight`), and the run directory, whose lock
this process holds for the whole run (:mod:`.runlock`). The workers receive the config so
checked, as the typed :class:`~shardline.train.schema.TrainConfig`.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from shardline import _torch_compat
from shardline.distributed import free_port
from shardline.errors import ShardlineError
from shardline.train.agentwait import grace_warning
from shardline.train.build import preflight
from shardline.train.config import compose_config, experiment_name, to_train_config, to_yaml, validate
from shardline.train.launcher_channel import ChannelServer
from shardline.train.parentwatch import bind_to_parent
from shardline.train.preemption import PREEMPTED, PREEMPTED_EXIT_CODE, Preempted
from shardline.train.preflight import check_data, check_storage, check_values

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from shardline.train.records import LOGS_DIR
from shardline.train.relay import SigtermRelay
from shardline.train.schema import TrainConfig
from shardline.train.worker import elastic_entry, open_run_dir, run_worker

__all__ = ["train"]

_FALLOUT = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "SignalException")
# Seconds torch's agent gives the workers after a SIGINT, SIGHUP or SIGQUIT to the launcher before it kills
# them. SIGTERM is the launcher's own (.relay); after a worker failure torch 2.13's agent waits a fixed 30 s,
# which the channel server cuts short for stalled workers (.launcher_channel).
_SHUTDOWN_S = 5
# The signals torch's agent handles in the launcher: all of its defaults but SIGTERM.
_AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def train(overrides: Sequence[str], *, print_config: bool = False, config_dirs: Sequence[str] = ()) -> int:
    """Run ``shardline train`` with Hydra-style ``overrides``; returns the process exit code.

    ``config_dirs`` are ``--config-dir`` folders with more experiment/strategy YAML files.
    """
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        composed = compose_config(overrides, config_dirs=config_dirs)
        if print_config:
            print(to_yaml(composed), end="")
            return 0
        cfg = to_train_config(composed)
        launched = _under_torchrun()
        validate(cfg, launched=launched)
        preflight(cfg)
        check_values(cfg)
        check_storage(cfg)
        check_data(cfg)
        experiment = experiment_name(overrides)
        if launched:
            bind_to_parent()  # torchrun's agent is the parent: never outlive it
            short = grace_warning(cfg.trainer.preemption_grace_s)
            if short and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
                err.print(f"warning: {short}", markup=False)
            try:
                run_worker(cfg, run_dir=None, experiment=experiment)
            except Preempted as stop:
                err.print(f"shardline: {stop}", markup=False)
                return PREEMPTED_EXIT_CODE
            return 0
        run_dir, lock = open_run_dir(cfg, experiment)
    except ShardlineError as exc:
        err.print("[bold red]error:[/]", escape(_one_line(exc)))
        return 2
    try:
        if lock.stale is not None:
            err.print(f"note: took over the stale lock of {run_dir}, left by {lock.stale.describe()}", markup=False)
        if cfg.trainer.devices == 1:
            return _run_here(cfg, run_dir, experiment, err)
        return _launch_local(cfg, run_dir, experiment, err)
    finally:
        lock.release()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _run_here(cfg: TrainConfig, run_dir: Path, experiment: str, err: Console) -> int:
    try:
        run_worker(cfg, run_dir=str(run_dir), experiment=experiment)
    except Preempted as stop:
        err.print(f"shardline: {stop}", markup=False)
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        err.print("[bold red]error:[/]", escape(f"rank 0 failed: {type(exc).__name__}: {first}"))
        err.print(traceback.format_exc().rstrip(), markup=False)
        err.print(f"log: {run_dir / LOGS_DIR / 'rank0.log'}", markup=False)
        return 1
    return 0


def _launch_local(cfg: TrainConfig, run_dir: Path, experiment: str, err: Console) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    devices = cfg.trainer.devices
    if cfg.trainer.accelerator != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // devices))
    launch = _torch_compat.elastic_launch_config(
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
            log_dir=str(run_dir / LOGS_DIR / "workers"),
            redirects=dict.fromkeys(range(1, devices), Std.ALL),
        ),
        shutdown_timeout=_SHUTDOWN_S,
        signals_to_handle=_AGENT_SIGNALS,
    )
    # We print the failing worker's error ourselves, once: silence torch's launcher loggers (each
    # sets its own level when imported, so the parent logger's level is not enough).
    quiet = [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger)
    ]
    previous = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    server = ChannelServer(devices, timeout_s=cfg.trainer.collective_timeout_s)
    relay = SigtermRelay(grace_s=cfg.trainer.preemption_grace_s, pids=server.pids).install()
    failed: BaseException | None = None
    results: dict[int, Any] = {}
    try:
        # Note: the typed config crosses the process boundary as is: torch's launcher pickles the
        # arguments for the workers it spawns, and a TrainConfig is plain dataclasses and data.
        entry = elastic_launch(launch, elastic_entry)
        results = entry(cfg, str(run_dir), experiment, server.address, os.getpid()) or {}
    except ChildFailedError as exc:
        failed = exc
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except SignalException as exc:  # torch's agent stopped the workers on a signal to this process
        if exc.sigval == signal.SIGINT:
            err.print("interrupted")
            return 130
        failed = exc
    except Exception as exc:  # torch's launcher failed on its own bookkeeping (e.g. an empty error file)
        failed = exc
    finally:
        relay.uninstall()
        server.close()
        for logger, level in zip(quiet, previous, strict=True):
            logger.setLevel(level)
    stopped = [r["message"] for r in results.values() if isinstance(r, dict) and PREEMPTED in r]
    terminated = relay.requested or (isinstance(failed, SignalException) and failed.sigval == signal.SIGTERM)
    if stopped or (terminated and server.preempted()):
        # Note: a worker reports its preemption only after the save committed on every rank.
        err.print(f"shardline: {stopped[0] if stopped else server.preempted()}", markup=False)
        return PREEMPTED_EXIT_CODE
    if failed is None:
        return 0
    headline, trace = _explain(failed, server, ChildFailedError)
    if terminated:
        headline = f"stopped by SIGTERM without a preemption checkpoint: {headline}"
    err.print("[bold red]error:[/]", escape(headline))
    if trace:
        err.print(trace.rstrip(), markup=False, highlight=False)
    err.print(f"logs of every rank: {run_dir / LOGS_DIR}", markup=False)
    return PREEMPTED_EXIT_CODE if terminated else 1


def _explain(failed: BaseException, server: ChannelServer, child_failed: type[ChildFailedError]) -> tuple[str, str]:
    """The first line naming the cause, and a traceback: from what the workers told the launcher, if anything."""
    verdict = server.verdict()
    if verdict is not None:
        return verdict
    if isinstance(failed, child_failed):
        try:
            rank, message, trace = _root_cause(failed)
            return f"worker rank {rank} failed: {message}", trace
        except Exception:  # never let the launcher's own bookkeeping hide the failure
            pass
    return (
        f"a worker failed and reported nothing; torch's launcher says: {type(failed).__name__}: "
        f"{' '.join(str(failed).split())[:300]} (a full disk can leave its error files empty)",
        "",
    )


def _root_cause(exc: ChildFailedError) -> tuple[int, str, str]:
    """The failure that caused the others: earliest, and not a peer noticing a dead rank."""
    failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
    real = [f for f in failures if not any(m in _failure_text(f[1]) for m in _FALLOUT)] or failures
    rank, failure = real[0]
    data = failure.error_file_data or {}
    message = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
    text = message.get("message") or ""
    if not text or text.startswith("To enable traceback"):
        text = f"exit code {failure.exitcode}" + (f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
    trace = message.get("extraInfo", {}).get("py_callstack", "")
    return failure.local_rank if hasattr(failure, "local_rank") else rank, text, trace


def _failure_text(failure: ProcessFailure) -> str:
    data = failure.error_file_data or {}
    return f"{failure.message} {data}"
