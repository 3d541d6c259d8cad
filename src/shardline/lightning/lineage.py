"""Lineage for Lightning's own sharding strategies: ``LineageFSDPStrategy`` and ``LineageModelParallelStrategy``.

A user of ``FSDPStrategy`` or ``ModelParallelStrategy`` changes one argument of ``Trainer(...)``
-- ``strategy=LineageFSDPStrategy(...)`` for ``strategy=FSDPStrategy(...)``, with the same
arguments -- and every checkpoint Lightning saves is a committed shardline checkpoint: each file
hashed while it is written, a manifest, an atomic commit and a row in ``lineage.sqlite`` beside
it; a resume verifies the checkpoint before Lightning reads any of it. See docs/foreign-engines.md.

Note: why a strategy subclass, not a ``CheckpointIO`` plugin or a callback. Both strategies write
sharded checkpoints themselves: ``save_checkpoint`` calls ``torch.distributed.checkpoint.save`` with
the directory and then ``torch.save``s the rest of the checkpoint to ``meta.pt`` on rank 0; they
refuse ``storage_options`` because they never call their ``CheckpointIO``, so a plugin is never
reached. A callback's ``on_save_checkpoint`` runs before the files exist and no hook runs after they
are written, and ``on_load_checkpoint`` runs after the weights were loaded: it could only hash the
files after the fact and check them after they were used. The subclass overrides the three
checkpoint methods (and ``setup``, to attach the run tags to the loggers' runs): ``save_checkpoint``
builds the state Lightning's own does (same keys) and passes it to ``dcp.save`` with
:class:`~shardline.checkpoint.Writer`, which also writes ``meta.pt`` (as ``extra_files``), so the
directory holds Lightning's own layout and Lightning's own strategies can resume from it;
``load_checkpoint`` verifies the checkpoint across the ranks
(:func:`~shardline.checkpoint.lifecycle.load.check_checkpoint`, every byte at the default level) and
then lets Lightning's own code load it; ``remove_checkpoint`` (``save_top_k`` pruning) records a
tombstone row first, so the ledger still verifies.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.api import CheckpointException

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.format.canonical import manifest_hash
from shardline.checkpoint.integrity.manifest import MANIFEST
from shardline.checkpoint.integrity.plan_validation import ShardlineSavePlanner
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.dcp_writer import Writer
from shardline.checkpoint.lifecycle.load import check_checkpoint
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.provenance.retention import retire
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    IntegrityError,
    ShardlineError,
)
from shardline.lightning.tracking import attach_run_tags, record_checkpoint

__all__ = ["LineageFSDPStrategy", "LineageModelParallelStrategy"]

META_FILE = "meta.pt"
"""The file Lightning's sharded checkpoints keep everything but the model and optimizers in (loops, callbacks,
hyper-parameters); the name its strategies look for."""


def _save(
    strategy: FSDPStrategy | ModelParallelStrategy,
    checkpoint: dict[str, Any],
    filepath: Any,
    *,
    model_key: str,
    parent: str | None,
    storage_options: Any,
    run_tags: Mapping[str, str],
) -> str | None:
    """Save Lightning's ``checkpoint`` as a shardline checkpoint in Lightning's layout; the manifest hash on rank 0."""
    name = type(strategy).__name__
    if storage_options is not None:
        raise ConfigurationError(f"{name}.save_checkpoint takes no storage_options (it writes a directory)")
    path = Path(strategy.broadcast(os.fspath(filepath))).absolute()
    rest = dict(checkpoint)
    state: dict[str, Any] = {model_key: rest.pop("state_dict")}
    for index, optimizer_state in enumerate(rest.pop("optimizer_states", [])):
        state[f"optimizer_{index}"] = optimizer_state
    extra = None
    if strategy.global_rank == 0:  # Lightning keeps rank 0's copy of the rest
        buffer = io.BytesIO()
        torch.save(rest, buffer)
        extra = {META_FILE: buffer.getvalue()}
    writer = Writer(
        path,
        step=int(checkpoint.get("global_step", 0)),
        parent_manifest_hash=parent,
        extra_files=extra,
        run_tags=run_tags,
    )
    try:
        dcp.save(state, storage_writer=writer, planner=ShardlineSavePlanner())
    except CheckpointException as e:  # DCP's gathered per-rank errors: raise the lowest failing rank's
        raise _save_error(path, e) from None
    return writer.info.manifest_hash if writer.info is not None else parent


def _save_error(path: Path, error: CheckpointException) -> ShardlineError:
    rank, (exc, _trace) = min(
        error.failures.items(), key=lambda item: (not isinstance(item[1][0], ShardlineError), item[0])
    )
    if isinstance(exc, CheckpointExistsError):
        return CheckpointExistsError(
            f"{exc} A committed checkpoint is never overwritten: with ModelCheckpoint, use save_last='link' (a link "
            "to the newest checkpoint) instead of save_last=True, and file names that differ per save (the default "
            "includes epoch and step)."
        )
    if isinstance(exc, ShardlineError):
        return coord.error_from_payload(coord.error_payload(exc))
    first = (str(exc).strip().splitlines() or [""])[0]
    return CheckpointError(f"saving checkpoint {path} failed on rank {rank}: {type(exc).__name__}: {first}")


def _verify(
    strategy: FSDPStrategy | ModelParallelStrategy, checkpoint_path: Any, level: VerifyLevel
) -> tuple[Path, str | None]:
    """Check the checkpoint on every rank before Lightning reads any of it (a collective): its path and manifest
    hash (None for a plain checkpoint loaded with ``verify="none"``)."""
    path = Path(strategy.broadcast(os.fspath(checkpoint_path)))
    try:
        manifest = check_checkpoint(path, level=level)
    except (CheckpointNotFoundError, IntegrityError) as e:
        if (path / META_FILE).is_file() and not (path / MANIFEST).exists():
            raise type(e)(
                f"{e}. It is a checkpoint of Lightning's own strategy (it has {META_FILE} but no {MANIFEST}): bring it "
                f"under lineage with `shardline adopt {path} --step N` (its hashes are then taken after the fact, and "
                "say so), then resume from it"
            ) from None
        raise
    return path, manifest_hash(manifest) if manifest is not None else None


def _remove(strategy: FSDPStrategy | ModelParallelStrategy, filepath: Any) -> None:
    """Delete a checkpoint ``ModelCheckpoint`` prunes, behind a tombstone row in the ledger beside it (a collective)."""
    path = Path(strategy.broadcast(os.fspath(filepath))).absolute()

    def retire_it() -> None:
        retire(path, ledger=Ledger(path.parent / LEDGER_NAME), reason="pruned by ModelCheckpoint (save_top_k)")

    coord.rank0_decides(retire_it, None)


class _LineageCheckpoints:
    """The checkpoint hooks both lineage strategies share; ``_model_key`` is where Lightning keeps the model state.

    Note: a mixin placed before the Lightning strategy in the bases, so ``super().load_checkpoint`` is that
    strategy's own load, run after every rank verified the checkpoint.
    """

    _model_key: str
    _verify_level: VerifyLevel
    _parent: str | None
    run_tags: dict[str, str]

    def setup(self, trainer: Any) -> None:
        """The Lightning strategy's setup; then the run tags go on the runs of the trainer's loggers."""
        super().setup(trainer)  # type: ignore[misc]
        attach_run_tags(trainer, self.run_tags)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save ``checkpoint`` as a committed shardline checkpoint directory at ``filepath`` (a collective)."""
        self._parent = _save(
            self._strategy(),
            checkpoint,
            filepath,
            model_key=self._model_key,
            parent=self._parent,
            storage_options=storage_options,
            run_tags=self.run_tags,
        )
        strategy = self._strategy()
        path = Path(strategy.broadcast(os.fspath(filepath))).absolute()
        record_checkpoint(strategy.lightning_module.trainer if strategy.lightning_module else None, path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the checkpoint on every rank, then load it as the Lightning strategy does."""
        path, self._parent = _verify(self._strategy(), checkpoint_path, self._verify_level)
        loaded: dict[str, Any] = super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        return loaded

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a pruned checkpoint behind a tombstone row in ``lineage.sqlite`` (a collective)."""
        _remove(self._strategy(), filepath)

    def _strategy(self) -> FSDPStrategy | ModelParallelStrategy:
        assert isinstance(self, (FSDPStrategy, ModelParallelStrategy))  # only mixed into those two
        return self


class LineageFSDPStrategy(_LineageCheckpoints, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` whose checkpoints are committed shardline checkpoints (see the module note).

    Takes ``FSDPStrategy``'s arguments. Checkpoints are sharded (``state_dict_type="sharded"``, the default
    here): a directory per checkpoint, in Lightning's layout, hashed while written, with a manifest and a row in
    ``lineage.sqlite`` beside it, chained to the checkpoint saved or resumed from before. A resume verifies the
    checkpoint first and refuses a damaged one on every rank, before anything is loaded.

    Args:
        verify: How much a resume checks: ``"full"`` (default: every byte against the manifest, the files shared
            over the ranks), or the opt-ins ``"sizes"`` and ``"none"`` (``"none"`` also loads a checkpoint of
            Lightning's own strategy, which has no manifest).
        run_tags: ``{key: value}`` strings the run is filed under (``{"ticket": "ABC-1"}``), recorded in every
            checkpoint's manifest and attached to the runs of the trainer's ``MLFlowLogger``, ``WandbLogger`` and
            ``TensorBoardLogger``, where each committed checkpoint is recorded too
            (:mod:`shardline.lightning.tracking`).
        **kwargs: ``FSDPStrategy``'s arguments.

    Raises:
        ConfigurationError: ``state_dict_type="full"`` (a single ``torch.save`` file, which has no lineage), or an
            unknown ``verify`` level.
    """

    _model_key = "model"

    def __init__(
        self, *, verify: VerifyLevel | str = VerifyLevel.FULL, run_tags: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        self.run_tags = check_run_tags(run_tags, where="run_tags")
        state_dict_type = kwargs.pop("state_dict_type", "sharded")
        if state_dict_type != "sharded":
            raise ConfigurationError(
                f"LineageFSDPStrategy saves sharded checkpoints (state_dict_type='sharded'), got "
                f"state_dict_type={state_dict_type!r}: a full checkpoint is one torch.save file with no lineage. Drop "
                "the argument, and export a full model with `shardline consolidate` when you need one."
            )
        super().__init__(state_dict_type="sharded", **kwargs)
        self._verify_level = VerifyLevel.parse(verify)
        self._parent: str | None = None


class LineageModelParallelStrategy(_LineageCheckpoints, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints are committed shardline checkpoints (see the module
    note).

    Takes ``ModelParallelStrategy``'s arguments; checkpoints are distributed (``save_distributed_checkpoint=True``,
    the default). Saves, resumes and pruning work as :class:`LineageFSDPStrategy`'s.

    Args:
        verify: How much a resume checks: ``"full"`` (default), ``"sizes"`` or ``"none"``.
        run_tags: As for :class:`LineageFSDPStrategy`.
        **kwargs: ``ModelParallelStrategy``'s arguments.

    Raises:
        ConfigurationError: ``save_distributed_checkpoint=False`` (a single ``torch.save`` file, which has no
            lineage), or an unknown ``verify`` level.
    """

    _model_key = "state_dict"

    def __init__(
        self, *, verify: VerifyLevel | str = VerifyLevel.FULL, run_tags: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        self.run_tags = check_run_tags(run_tags, where="run_tags")
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ConfigurationError(
                "LineageModelParallelStrategy saves distributed checkpoints (save_distributed_checkpoint=True), got "
                f"save_distributed_checkpoint={kwargs['save_distributed_checkpoint']!r}: a full checkpoint is one "
                "torch.save file with no lineage. Drop the argument, and export a full model with "
                "`shardline consolidate` when you need one."
            )
        super().__init__(**kwargs)
        self._verify_level = VerifyLevel.parse(verify)
        self._parent: str | None = None
