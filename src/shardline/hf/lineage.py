"""``LineageCallback``: verified lineage for a Hugging Face ``Trainer`` that shards with its own FSDP.

For a user who keeps ``Trainer(fsdp=...)`` (or ``accelerate launch`` with an FSDP config) and its
checkpoints, rather than :class:`~shardline.hf.ShardlineTrainer`: one callback, and every
``checkpoint-N`` Trainer writes is brought under lineage, and every resume is verified.

* **Saves** (``on_save``, every rank, after Trainer wrote ``checkpoint-N``): a barrier, so every
  rank's files are on disk; then rank 0 adopts the folder in place
  (:func:`shardline.checkpoint.adopt` with ``subfolders=True``): Accelerate's DCP folders
  (``pytorch_model_fsdp_0/``, ``optimizer_0/``) are checked against their ``.metadata``, and they
  and the files beside them (``trainer_state.json``, ``scheduler.pt``, ``rng_state_R.pth``, a
  tokenizer's files) are hashed into one manifest, whose parent is the previous save (or the
  checkpoint resumed). The ledger ``output_dir/lineage.sqlite`` gets a commit row marked adopted;
  the checkpoints Trainer's ``save_total_limit`` deleted get tombstone rows. Every rank learns the
  outcome, or the same error. The adopted checkpoint's record (manifest, sharding, parent, file
  table) then goes to the MLflow and W&B runs ``report_to`` started (:mod:`shardline.hf.tracking`).
* **Resumes** (``on_train_begin``, when Trainer restored a step > 0): rank 0 verifies the
  resumed ``checkpoint-N`` -- every byte against its manifest, the manifest against the hash the
  ledger recorded -- and every rank raises if it is damaged or not under lineage. Later
  ``checkpoint-M`` folders (an abandoned branch whose names the coming saves would take) are moved to
  ``output_dir/abandoned/``, recorded in the ledger; a fresh start over adopted checkpoints is refused.

Note: when the resume is verified. Trainer calls no callback between ``train()`` and the loading
of the checkpoint (Accelerate reads the model and optimizer while preparing them), so the
verification runs after those bytes were read, and before the first training step: a damaged
checkpoint stops ``train()`` with nothing trained or saved from it. The hashes prove what was on
disk at the save; they were taken after Accelerate wrote the files (the manifest says so), not
while it wrote them, as :func:`shardline.checkpoint.save` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from shardline._transformers_compat import PREFIX_CHECKPOINT_DIR
from shardline.checkpoint.coordination.coord import rank0_decides
from shardline.checkpoint.integrity.manifest import MANIFEST
from shardline.checkpoint.integrity.verify import VerifyLevel, verify_checkpoint
from shardline.checkpoint.lifecycle.adopt import adopt
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.errors import CheckpointExistsError, CheckpointNotFoundError, ConfigurationError, IntegrityError
from shardline.hf.checkpoints import record_rotations
from shardline.hf.resume import checkpoints_in, move_to_abandoned
from shardline.hf.tracking import attach_run_tags, record_checkpoint

__all__ = ["LineageCallback"]

_SHARDED = "SHARDED_STATE_DICT"
_SHOW = 5


class LineageCallback(TrainerCallback):
    """Bring each ``checkpoint-N`` of a ``Trainer`` under FSDP under lineage, and verify it before resuming.

    >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[shardline.hf.LineageCallback()])

    ``args`` shard with FSDP and save sharded state dicts: ``fsdp=True`` (or ``"full_shard"``) with
    ``fsdp_config={"state_dict_type": "SHARDED_STATE_DICT", ...}``, or an ``accelerate launch``
    FSDP config with ``fsdp_state_dict_type: SHARDED_STATE_DICT``. See docs/foreign-engines.md.

    Args:
        verify: What a resume checks first: ``"full"`` (default: every byte hashed against the
            manifest) or ``"sizes"``.
        run_tags: ``{key: value}`` strings the run is filed under (``{"ticket": "ABC-1"}``),
            recorded in every adopted checkpoint's manifest and attached to the MLflow and W&B runs
            ``report_to`` started, where each adopted checkpoint is recorded too
            (:mod:`shardline.hf.tracking`; Trainer's TensorBoard writer is out of a callback's reach).

    Raises:
        ConfigurationError: ``verify`` is ``"none"`` or unknown, a bad run tag; at ``train()``, arguments that do
            not save sharded DCP checkpoints.
        IntegrityError: at ``train()``, the resumed checkpoint does not verify.
        CheckpointNotFoundError: at ``train()``, the resumed checkpoint is not under lineage.
        CheckpointExistsError: at ``train()``, a start from step 0 in an ``output_dir`` holding
            adopted checkpoints.
    """

    def __init__(
        self, *, verify: VerifyLevel | str = VerifyLevel.FULL, run_tags: Mapping[str, str] | None = None
    ) -> None:
        self.run_tags = check_run_tags(run_tags, where="run_tags")
        level = VerifyLevel.parse(verify)
        if level is VerifyLevel.NONE:
            raise ConfigurationError(
                "LineageCallback(verify='none') would resume without checking: use 'full' (default) or 'sizes'"
            )
        self.verify = level
        self.parent_manifest_hash: str | None = None
        """The manifest hash the next save records as its parent (the last save's, or the resumed one's)."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Check the arguments; on a resume, verify the checkpoint and move later ones aside (every rank)."""
        _require_sharded_saves(args)
        run = Path(_output_dir(args)).absolute()
        step = int(state.global_step)
        resumed = _resumed_folder(args, run, step) if step > 0 else None
        level = self.verify
        self.parent_manifest_hash = rank0_decides(lambda: _begin(run, step, resumed, level), None)
        if state.is_world_process_zero:  # Trainer's integrations opened their runs there
            attach_run_tags(self.run_tags)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Adopt the ``checkpoint-N`` Trainer just wrote, and record what its rotation deleted (every rank)."""
        run = Path(_output_dir(args)).absolute()
        step = int(state.global_step)
        folder = run / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        parent = self.parent_manifest_hash
        if dist.is_initialized():
            dist.barrier()  # every rank's files (its DCP shards, rng_state_R.pth) are written before rank 0 hashes
        tags = self.run_tags
        self.parent_manifest_hash = rank0_decides(lambda: _adopt(folder, run, step, parent, tags), None)
        record_rotations(run, "deleted by Trainer (save_total_limit)")
        record_checkpoint(folder, name=folder.name)


def _output_dir(args: TrainingArguments) -> str:
    output_dir = args.output_dir
    if output_dir is None:
        raise ConfigurationError("LineageCallback needs TrainingArguments(output_dir=...): its checkpoints go there")
    return output_dir


def _require_sharded_saves(args: TrainingArguments) -> None:
    """Refuse arguments whose checkpoints hold no DCP folders to adopt (before any step is trained)."""
    fsdp = bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not fsdp:
        raise ConfigurationError(
            "LineageCallback brings the sharded checkpoints of Trainer's FSDP under lineage, but FSDP is not "
            "enabled (no fsdp= in TrainingArguments, no Accelerate FSDP config). Enable FSDP with "
            f"fsdp_config={{'state_dict_type': '{_SHARDED}'}}, or let shardline shard and checkpoint: "
            "shardline.hf.ShardlineTrainer (docs/hf_trainer.md)"
        )
    config = getattr(args, "fsdp_config", None) or {}
    kind = config.get("state_dict_type", config.get("fsdp_state_dict_type"))
    if kind is None and not getattr(args, "fsdp", None):
        kind = os.environ.get("FSDP_STATE_DICT_TYPE")  # set by `accelerate launch` from its FSDP config
    if str(kind).upper().removeprefix("STATEDICTTYPE.") != _SHARDED:
        raise ConfigurationError(
            f"LineageCallback adopts the DCP folders FSDP writes with state_dict_type {_SHARDED}, but this run "
            f"saves {kind or 'FULL_STATE_DICT (the default)'}: set fsdp_config={{'state_dict_type': '{_SHARDED}'}} "
            f"(or fsdp_state_dict_type: {_SHARDED} in the Accelerate config)"
        )


def _resumed_folder(args: TrainingArguments, run: Path, step: int) -> Path:
    """The folder Trainer resumed at ``step``: ``args.resume_from_checkpoint`` if set, else ``checkpoint-<step>``.

    Note: Trainer does not tell callbacks which folder ``train(resume_from_checkpoint=...)`` loaded,
    only the state it restored from it; ``True`` and the path of ``output_dir/checkpoint-N`` both mean
    ``checkpoint-<global step>``. A checkpoint elsewhere is named in ``TrainingArguments(resume_from_checkpoint=)``.
    """
    given = getattr(args, "resume_from_checkpoint", None)
    if isinstance(given, (str, os.PathLike)) and os.fspath(given):
        return Path(given).absolute()
    return run / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def _recorded_hash(ledger: Ledger, folder: Path) -> str | None:
    """The manifest hash the ledger's newest commit row for ``folder`` records (None: no ledger, no row)."""
    if not ledger.path.is_file():
        return None
    name = ledger.name_of(folder)
    return next((r.manifest_sha256 for r in reversed(ledger.rows()) if r.is_commit and r.checkpoint == name), None)


def _begin(run: Path, step: int, resumed: Path | None, level: VerifyLevel) -> str | None:
    """Rank 0: verify the resumed folder (its manifest hash out) and move later ones aside; or refuse a fresh
    start over adopted checkpoints."""
    later = [folder for n, folder in checkpoints_in(run) if n > step and folder != resumed]
    if resumed is None:
        adopted = [f.name for f in later if (f / MANIFEST).is_file()]
        if adopted:
            raise CheckpointExistsError(
                f"{run} already holds {', '.join(adopted[:_SHOW])} under lineage, and this train() starts from step "
                "0: Trainer would write its saves into those folders. To continue that run, "
                "train(resume_from_checkpoint=True); to start over, use a new output_dir or move them away."
            )
        return None
    digest = _verify_resumed(resumed, level)
    back_to = resumed.name if resumed.parent == run else str(resumed)
    for folder in later:
        move_to_abandoned(run, folder, f"abandoned: training went back to {back_to} (step {step})", inner="")
    return digest


def _verify_resumed(folder: Path, level: VerifyLevel) -> str:
    """Rank 0: ``folder`` verified (its files; its manifest against the hash its ledger recorded); the hash."""
    ledger = Ledger(folder.parent / LEDGER_NAME)  # where the callback recorded it when it was saved
    where = f"cannot resume from {folder}"
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"{where}: no such directory. LineageCallback verifies the checkpoint Trainer resumed; for one outside "
            "output_dir, also pass its path as TrainingArguments(resume_from_checkpoint=...)"
        )
    if not (folder / MANIFEST).is_file():
        raise CheckpointNotFoundError(
            f"{where}: it is not under lineage (no {MANIFEST}; saved without LineageCallback?), so it cannot be "
            f"verified. Bring it under lineage first -- `shardline adopt {folder} --subfolders` hashes it as it is "
            "now -- then resume again."
        )
    report = verify_checkpoint(folder, level=level, expected_manifest_hash=_recorded_hash(ledger, folder))
    if not report.ok:
        problems = "; ".join(f"{p.kind} {p.path}: {p.detail}" for p in report.problems[:_SHOW])
        more = f"; and {len(report.problems) - _SHOW} more" if len(report.problems) > _SHOW else ""
        raise IntegrityError(
            f"{where}: it does not verify ({problems or report.error}{more}). Training stopped before its first "
            "step; nothing was trained or saved from it. Resume from an earlier checkpoint "
            f"(`shardline verify {folder}` shows what changed; `shardline lineage {ledger.path.parent}` lists them)."
        )
    assert report.manifest_hash is not None  # a report that is ok read the manifest
    return report.manifest_hash


def _adopt(folder: Path, run: Path, step: int, parent: str | None, tags: Mapping[str, str]) -> str:
    """Rank 0: adopt ``folder`` (all its DCP subfolders and loose files); its manifest hash."""
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"LineageCallback found no {folder} after Trainer's save at step {step}: is output_dir on a file "
            "system every rank sees, and was the checkpoint written there (not moved by another callback; "
            "hyperparameter search's run-N folders are not supported)?"
        )
    if not any(child.is_dir() for child in folder.iterdir()):
        raise ConfigurationError(
            f"{folder} holds no DCP folder to adopt ({', '.join(sorted(p.name for p in folder.iterdir())[:8])}): "
            f"FSDP saved full state dicts; set fsdp_config={{'state_dict_type': '{_SHARDED}'}}"
        )
    done = adopt(
        folder, step=step, ledger=run / LEDGER_NAME, subfolders=True, parent_manifest_hash=parent, run_tags=tags
    )
    return done.manifest_hash
