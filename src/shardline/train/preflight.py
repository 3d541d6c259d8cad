"""Checks the launcher runs before any worker starts: every bad input is one error line and exit code 2.

Beyond the schema and :func:`~shardline.train.config.validate` (types, ranges) and
:func:`~shardline.train.build.preflight` (class paths, policies on the meta model):

* :func:`check_values` -- numbers that must be finite (``optimizer.lr=nan``), optimizer ranges;
* :func:`check_data` -- the corpus is built here once, exactly as the workers will build it
  (``data.root`` missing, ``data.max_bytes`` too small, too little data for ``data.seq_len``);
* :func:`check_resume` -- what a resume will load: an explicit ``trainer.resume`` must be a
  committed checkpoint (its manifest anchored, its files present with their sizes; the workers
  hash every byte), and the model this config builds must fit it -- keys, shapes and dtypes read
  from the checkpoint's manifest, compared with the model built on the meta device. With
  ``resume=auto`` a run directory that holds an earlier attempt's records but no checkpoint is
  refused instead of restarted over them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardline.checkpoint.format.dcp_io import MODEL_KEY, key_paths
from shardline.checkpoint.integrity.opening import check_manifest, read_checked_metadata
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.capture import dtype_name
from shardline.checkpoint.lifecycle.load import load_trainer_state
from shardline.checkpoint.lifecycle.manager import is_auto_resume, no_resume
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.provenance.lineage import order
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.engine.nf4 import is_nf4
from shardline.errors import CheckpointError, ConfigurationError
from shardline.train.build import build_model
from shardline.train.data import load_corpus, make_batches
from shardline.train.global_batch import plan_global_batch
from shardline.train.records import RECORDS, checkpoint_location
from shardline.train.schema import TrainConfig

__all__ = ["check_data", "check_resume", "check_storage", "check_values", "recorded_global_batch", "world_size"]

_SHOW = 4


def world_size(cfg: TrainConfig) -> int:
    """Ranks the job will have: torchrun's ``WORLD_SIZE``, else devices x nodes."""
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env and env.isdigit() else int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)


def _floats(node: Any, where: str) -> list[tuple[str, float]]:
    if isinstance(node, float):
        return [(where, node)]
    if isinstance(node, Mapping):
        return [item for k, v in node.items() for item in _floats(v, f"{where}.{k}" if where else str(k))]
    if isinstance(node, (list, tuple)):
        return [item for i, v in enumerate(node) for item in _floats(v, f"{where}[{i}]")]
    return []


def check_values(cfg: TrainConfig) -> None:
    """Every number in the config is finite; the optimizer's hyper-parameters are in range.

    Raises:
        ConfigurationError: naming the key, its value and what is allowed.
    """
    for key, value in _floats(cfg.to_dict(), ""):
        if not math.isfinite(value):
            raise ConfigurationError(f"{key}={value} is not a finite number; set it to a real value")
    opt = cfg.optimizer
    for i, beta in enumerate(opt.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigurationError(f"optimizer.betas[{i}]={beta}; each beta must be in [0, 1), e.g. [0.9, 0.95]")
    if opt.eps <= 0:
        raise ConfigurationError(f"optimizer.eps={opt.eps}; it must be positive (e.g. 1e-8)")
    if opt.weight_decay < 0:
        raise ConfigurationError(f"optimizer.weight_decay={opt.weight_decay}; it must be >= 0")


def check_data(cfg: TrainConfig, *, recorded_global_batch: int | None = None) -> None:
    """Build the corpus and the batch splitting exactly as the workers will (a fraction of a second).

    Args:
        recorded_global_batch: The global batch of the checkpoint a resume will load, if known
            (see :func:`recorded_global_batch`).

    Raises:
        ConfigurationError: ``data.root`` missing or unreadable, too little data, a global batch
            that this world size cannot divide.
    """
    data = cfg.data
    if data.name == "stdlib" and data.root is not None:
        root = Path(str(data.root))
        if not root.exists():
            raise ConfigurationError(f"data.root={data.root}: no such directory; point it at a directory of .py files")
        if not root.is_dir():
            raise ConfigurationError(f"data.root={data.root} is a file, not a directory of .py files")
    try:
        corpus = load_corpus(data)
    except OSError as e:
        where = f"data.root={data.root}" if data.name == "stdlib" else f"data.path={data.path}"
        raise ConfigurationError(f"{where}: cannot read the corpus ({e.strerror or e})") from None
    world = world_size(cfg)
    trainer = cfg.trainer
    plan = plan_global_batch(
        micro_batch=trainer.micro_batch_size,
        accumulate=trainer.accumulate_grad_batches,
        world_size=world,
        configured=trainer.global_batch_size,
        recorded=recorded_global_batch,
    )
    for split in ("train", "val"):
        try:
            make_batches(
                corpus, split, seq_len=data.seq_len, global_batch=plan.global_batch, rank=0, world_size=world, seed=0
            )
        except ConfigurationError as e:
            size = f"data.max_bytes={data.max_bytes}" if data.name == "stdlib" else f"data.name={data.name}"
            raise ConfigurationError(f"{'validation' if split == 'val' else split} data: {e} ({size})") from None


def _stored_state(path: Location, verify: VerifyLevel) -> dict[str, tuple[tuple[int, ...], str]]:
    """``key -> (shape, dtype)`` of the model entries a checkpoint holds (its manifest; else its .metadata).

    The manifest is anchored, the listing checked and ``.metadata`` hashed here; the workers hash the data files.
    """
    checked = check_manifest(path, level=VerifyLevel.SIZES if verify is VerifyLevel.FULL else verify)
    metadata = read_checked_metadata(checked)  # small: hashed against the manifest, then unpickled safely
    state = (checked.manifest or {}).get("model", {}).get("state")
    if isinstance(state, dict):
        return {k: (tuple(v[0]), str(v[1])) for k, v in state.items()}
    paths = key_paths(metadata)
    flat = not any(p[0] == MODEL_KEY for p in paths.values())
    out = {}
    for key, p in paths.items():
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata) or (not flat and (len(p) != 2 or p[0] != MODEL_KEY)):
            continue
        out[p[-1]] = (tuple(md.size), dtype_name(md.properties.dtype))
    return out


def _fit_problems(cfg: TrainConfig, stored: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    model = build_model(cfg, device="meta")
    have = {
        k: (tuple(v.shape), dtype_name(v.dtype))
        for k, v in model.state_dict(keep_vars=True).items()
        if not is_nf4(v)  # 4-bit frozen base weights are not checkpointed (engine/quantized.py)
    }
    problems = [f"the checkpoint lacks {k}" for k in sorted(have.keys() - stored.keys())]
    problems += [f"the model lacks {k}" for k in sorted(stored.keys() - have.keys())]
    for key in sorted(have.keys() & stored.keys()):
        (shape, dtype), (want, want_dtype) = stored[key], have[key]
        if shape != want and not (want == () and shape == (1,)):
            problems.append(f"{key}: checkpoint shape {shape} vs model {want}")
        elif dtype != want_dtype:
            problems.append(f"{key}: checkpoint dtype {dtype} vs model {want_dtype}")
    return problems


def check_storage(cfg: TrainConfig) -> None:
    """An object-store ``checkpoint.dir`` is reachable: its bucket exists and the credentials may list it.

    Checked by the launcher before any worker starts (nothing for a local directory).

    Raises:
        StorageAccessError: one line naming the bucket, the endpoint and how to fix it.
        ConfigurationError: a URL naming no bucket, or an unknown protocol.
    """
    where = checkpoint_location(cfg.checkpoint, ".")
    store_for(where).check_access(where)


def check_resume(cfg: TrainConfig, run_dir: Path | None) -> None:
    """The checkpoint a resume will load exists, is committed and fits the configured model (see the module note).

    Args:
        run_dir: The run directory (for ``resume=auto``); None when not known yet.

    Raises:
        ConfigurationError: one line naming the checkpoint and what does not fit.
    """
    resume = cfg.trainer.resume
    if no_resume(resume):
        return
    level = VerifyLevel.parse(cfg.checkpoint.verify)
    if is_auto_resume(resume):
        if run_dir is None:
            return
        committed, damaged = scan(checkpoint_location(cfg.checkpoint, run_dir))
        if not committed and not damaged:
            records = [n for n in RECORDS if (run_dir / n).is_file() and (run_dir / n).stat().st_size > 0]
            if records:
                raise ConfigurationError(
                    f"trainer.resume=auto: {run_dir} holds an earlier run's records ({', '.join(records)}) but no "
                    "committed checkpoint to resume from; restarting at step 0 there would mix two trainings. Start "
                    "a new run (another trainer.run_dir), or restore its checkpoints."
                )
            return
        if not committed:
            return  # only damaged ones: the workers move them aside and start over (or refuse, with records)
        ledger = Ledger(run_dir / LEDGER_NAME)
        try:
            rows = ledger.rows() if ledger.path.is_file() else []
        except CheckpointError:
            rows = []  # a ledger that does not open: the workers refuse it, naming the problem
        path, what = order(committed, rows)[-1].path, "trainer.resume=auto"
        try:
            stored = _stored_state(path, VerifyLevel.NONE)
        except CheckpointError:
            return  # damaged: the workers verify it, move it aside and fall back to an older one
    else:
        # A URL is read with the run's checkpoint.storage_options (its endpoint and credentials).
        path = locate(str(resume), storage_options=dict(cfg.checkpoint.storage_options or {}))
        what = f"trainer.resume={resume}"
        try:
            store_for(path).check_access(path)
            stored = _stored_state(path, level)
        except CheckpointError as e:
            raise ConfigurationError(f"{what}: {e}") from None
    trainer = cfg.trainer
    plan_global_batch(  # a world size that cannot keep the run's global batch: one line, before any worker
        micro_batch=trainer.micro_batch_size,
        accumulate=trainer.accumulate_grad_batches,
        world_size=world_size(cfg),
        configured=trainer.global_batch_size,
        recorded=recorded_global_batch(path),
    )
    problems = _fit_problems(cfg, stored)
    if problems:
        more = f"; and {len(problems) - _SHOW} more" if len(problems) > _SHOW else ""
        raise ConfigurationError(
            f"{what}: checkpoint {path} does not fit the configured model -- {'; '.join(problems[:_SHOW])}{more}. "
            f"Resume with the model config it was saved with (`shardline inspect {path}`), or start a new run."
        )


def recorded_global_batch(path: Location) -> int | None:
    """The global batch a committed checkpoint's trainer state records (None: not recorded, or unreadable here).

    Unreadable is left to the workers, which verify the checkpoint and name what is wrong.
    """
    try:
        state = load_trainer_state(path, verify=VerifyLevel.NONE)
    except (CheckpointError, OSError, ValueError, KeyError):
        return None
    value = (state.get("data") or {}).get("global_batch") if isinstance(state, dict) else None
    return int(value) if isinstance(value, int) else None
