"""``ShardlineTrainer`` and ``sharded(TrainerCls)``: ``transformers.Trainer`` training a model sharded by shardline.

The user swaps the class and nothing else. At construction the trainer checks its arguments
(:mod:`shardline.hf.options`), shards the model -- every block the model declares in
``_no_split_modules`` becomes a unit, then the root; rank 0's weights are broadcast first, as
DDP does -- and teaches Trainer's accelerator to leave data parallelism to shardline
(:mod:`shardline.hf.accelerator`). Training, evaluation, the learning-rate schedule, logging
and callbacks are Trainer's own. Checkpoints are shardline checkpoints
(:mod:`shardline.hf.checkpoints`).

Note: the Trainer methods overridden. Public: ``create_accelerator_and_postprocess`` (to adapt
the accelerator it creates), ``train`` (to settle which checkpoint it resumes and move the
later ones aside first, :mod:`shardline.hf.resume`) and ``save_model``. Trainer has no public
hook for what a checkpoint holds, so five underscore methods are overridden, each as a whole
and each small: ``_save_checkpoint`` (marks that ``save_model`` is writing a checkpoint, runs
Trainer's own, then records in the ledger the checkpoints Trainer's rotation deleted),
``_save_optimizer_and_scheduler`` (nothing: both are in the shardline checkpoint),
``_load_from_checkpoint`` (only checks that the folder holds a shardline checkpoint: the
optimizer does not exist yet at that point of ``train()``),
``_load_optimizer_and_scheduler`` (verifies and loads model, optimizer, scheduler and the fp16
loss scaler together) and ``_load_best_model`` (``load_best_model_at_end``: verifies and loads the
model of the checkpoint Trainer chose as best). Under transformers 5, ``_save_scaler`` and
``_load_scaler`` do nothing: the loss scaler's state is in the shardline checkpoint
(:mod:`shardline.hf.scaler`); they read no parameter, so no signature is checked for them.

Note: one integration across transformers releases. Each override names only the leading
parameters it reads and passes everything else on (``*args, **kwargs``), so releases that add
parameters keep working. Those leading parameters are checked against the installed
transformers once, at import (:mod:`shardline._transformers_compat`), and against each class
:func:`sharded` is given, so a release that renames, moves or drops one fails at once, naming
the version and the supported range, instead of writing incomplete checkpoints.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

import shardline.checkpoint as ckpt
from shardline._transformers_compat import SUPPORTED_TRANSFORMERS, check_trainer_class
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.distributed import init_distributed
from shardline.engine import LossScaling, MixedPrecision, ShardedModule, ShardingStrategy, original_class, wrap
from shardline.errors import ConfigurationError
from shardline.hf.accelerator import for_sharded_model
from shardline.hf.checkpoints import (
    export_pretrained,
    load_training_checkpoint,
    record_rotations,
    require_checkpoint,
    save_training_checkpoint,
)
from shardline.hf.options import WrapPolicyLike, refused_arguments, resolve_mixed_precision, resolve_wrap_policy
from shardline.hf.resume import prepare_resume
from shardline.hf.scaler import TrainerGradScaler, install_scaler, wants_scaler
from shardline.hf.tracking import RunTagsCallback, record_checkpoint

__all__ = ["SUPPORTED_TRANSFORMERS", "ShardlineTrainer", "ShardlineTrainerMixin", "sharded"]


def _is_peft(model: nn.Module) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict) and hasattr(model, "get_base_model")


if TYPE_CHECKING:
    from transformers.trainer_utils import TrainOutput

    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ShardlineTrainerMixin(_TrainerBase):
    """What :func:`sharded` adds to a Trainer class (see :class:`ShardlineTrainer` for the arguments).

    Note: a mixin, placed before the Trainer class it extends; type checkers see it as a ``Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        auto_wrap_policy: WrapPolicyLike = None,
        sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        mixed_precision: MixedPrecision | None = None,
        reshard_after_forward: bool | int | None = None,
        verify: ckpt.VerifyLevel | str = ckpt.VerifyLevel.FULL,
        loss_scaling: LossScaling | None = None,
        run_tags: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self._shardline_run_tags = check_run_tags(run_tags, where="run_tags")
        self._shardline_strategy = ShardingStrategy.parse(sharding_strategy)
        self._shardline_verify = ckpt.VerifyLevel.parse(verify)
        self._shardline_saving = False
        self._shardline_parent: str | None = None
        self._shardline_run_dir: str | None = None
        self._shardline_scaler: TrainerGradScaler | None = None
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        training_args = bound.arguments.get("args")
        if training_args is not None:
            _refuse(refused_arguments(training_args), type(self).__name__)
        super().__init__(*args, **kwargs)
        problems = refused_arguments(self.args)
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            problems.append(
                "the Accelerate configuration enables FSDP or DeepSpeed (e.g. accelerate launch --config_file with "
                "distributed_type FSDP/DEEPSPEED); shardline shards the model itself: use a config with "
                "distributed_type MULTI_GPU (one process per device; see docs/hf_trainer.md), or keep the FSDP "
                "config with transformers.Trainer and callbacks=[shardline.hf.LineageCallback()]"
            )
        if getattr(self, "model_init", None) is not None:
            problems.append(
                "model_init= is set: Trainer would build a new, unsharded model inside train(); build the model "
                "and pass it as model= (hyperparameter search is not supported)"
            )
        _refuse(problems, type(self).__name__)
        self._shardline_mixed_precision = resolve_mixed_precision(self.args, mixed_precision)
        fp16 = wants_scaler(bool(self.args.fp16), self._shardline_mixed_precision)
        if loss_scaling is not None and not fp16:
            raise ConfigurationError(
                f"loss_scaling= is set but {type(self).__name__} computes no fp16 gradients; it applies with fp16=True "
                "(or mixed_precision=MixedPrecision(param_dtype=torch.float16)): set one, or remove loss_scaling="
            )
        self._shard(auto_wrap_policy, reshard_after_forward)
        if fp16:  # before train() prepares the optimizer: AcceleratedOptimizer takes the accelerator's scaler
            self._shardline_scaler = install_scaler(self.accelerator, self._sharded_model, loss_scaling)
        if self._shardline_run_tags:  # after report_to's integrations: their runs are open when it runs
            self.add_callback(RunTagsCallback(self._shardline_run_tags, lambda: self.callback_handler.callbacks))

    @property
    def _sharded_model(self) -> nn.Module:
        """The model, sharded by ``__init__`` (which refuses a trainer without one)."""
        model = self.model
        assert model is not None
        return model

    @property
    def _output_dir(self) -> str:
        """``args.output_dir``; TrainingArguments sets it (``trainer_output``) when it is not given."""
        output_dir = self.args.output_dir
        assert output_dir is not None
        return output_dir

    # ------------------------------------------------------------------ sharding
    def _shard(self, policy: WrapPolicyLike, reshard_after_forward: bool | int | None) -> None:
        model = self.model
        if model is None:
            raise ConfigurationError(f"{type(self).__name__} needs a model: pass model=")
        if any(isinstance(m, ShardedModule) for m in model.modules()):
            raise ConfigurationError(
                f"the {original_class(model).__name__} given to {type(self).__name__} is already sharded; pass the "
                "unsharded model: the trainer shards it (auto_wrap_policy=, sharding_strategy=)"
            )
        wrap_policy = resolve_wrap_policy(model, policy)
        if not dist.is_initialized():  # one process (python train.py): a one-rank group
            init_distributed(timeout=float(self.args.ddp_timeout))
        device = self.args.device
        if any(p.device != device for p in model.parameters()):
            model.to(device)
        wrap(
            model,
            wrap_policy,
            strategy=self._shardline_strategy,
            mixed_precision=self._shardline_mixed_precision,
            reshard_after_forward=reshard_after_forward,
            sync_module_states=True,  # every rank starts from rank 0's weights, as with DDP
        )

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, adapted to the sharded model (see :mod:`shardline.hf.accelerator`)."""
        super().create_accelerator_and_postprocess()
        self.accelerator = for_sharded_model(self.accelerator, lambda: getattr(self, "model", None))

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """Trainer's ``train``; before it starts, the checkpoint it resumes is settled (every rank).

        ``resume_from_checkpoint=True`` takes the newest complete ``checkpoint-N``, passing over
        incomplete saves (a warning names each). Resuming an earlier checkpoint moves the later
        ones -- the abandoned branch -- to ``output_dir/abandoned/``, recorded in the ledger,
        where Trainer would overwrite them. See :mod:`shardline.hf.resume`.

        Raises:
            CheckpointNotFoundError: an explicit path that is missing or an incomplete save (the
                message names what is missing and the newest complete checkpoint), or ``True``
                with no complete checkpoint.
            CheckpointExistsError: a start without ``resume_from_checkpoint`` in an ``output_dir``
                that holds checkpoints (the message lists the ways on).
        """
        resume = prepare_resume(self._output_dir, resume_from_checkpoint)
        output = super().train(resume, *args, **kwargs)
        # With load_best_model_at_end and save_total_limit=1, Trainer deletes the last checkpoint-N as train() ends.
        if self._shardline_run_dir is not None:
            record_rotations(self._shardline_run_dir, "deleted by Trainer (save_total_limit)")
        return output

    def _save_checkpoint(self, model: nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
        self._shardline_saving = True
        try:
            super()._save_checkpoint(model, trial, *args, **kwargs)
        finally:
            self._shardline_saving = False
        # Trainer's save_total_limit may have deleted older checkpoint-N folders: the ledger records it.
        if self._shardline_run_dir is not None:
            record_rotations(self._shardline_run_dir, "deleted by Trainer (save_total_limit)")

    def save_model(self, output_dir: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Save the model: a consolidated Hugging Face folder ``from_pretrained`` loads (a collective: every rank).

        ``model.safetensors`` + ``config.json`` (+ ``generation_config.json``), or for a PEFT
        model its adapter (``adapter_model.safetensors`` + ``adapter_config.json``), plus the
        tokenizer / processor and ``training_args.bin`` as Trainer writes them. Nothing is
        gathered: see :mod:`shardline.hf.checkpoints`. Inside Trainer's periodic saves, the
        shardline checkpoint of ``checkpoint-N/`` is written instead.
        """
        output_dir = output_dir if output_dir is not None else self._output_dir
        if self._shardline_saving:
            include_optimizer = not self.args.save_only_model
            info = save_training_checkpoint(
                output_dir,
                model=self._sharded_model,
                optimizer=_inner_optimizer(self.optimizer) if include_optimizer else None,
                scheduler=self.lr_scheduler if include_optimizer else None,
                scaler=self._shardline_scaler if include_optimizer else None,
                step=int(self.state.global_step),
                config=self.args.to_sanitized_dict(),
                parent_manifest_hash=self._shardline_parent,
                run_tags=self._shardline_run_tags,
            )
            self._shardline_parent = info.manifest_hash
            self._shardline_run_dir = os.path.dirname(os.path.abspath(output_dir))
            record_checkpoint(
                str(info.path),
                name=os.path.basename(os.path.abspath(output_dir)),
                callbacks=self.callback_handler.callbacks,
            )
            return
        os.makedirs(output_dir, exist_ok=True)
        model = self._sharded_model
        export_pretrained(output_dir, model=model, step=int(self.state.global_step), adapters=_is_peft(model))
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_best_model(self, *args: Any, **kwargs: Any) -> None:
        """``load_best_model_at_end``: the model of Trainer's best checkpoint (``state.best_model_checkpoint``, chosen
        by ``metric_for_best_model``) -- its shardline checkpoint, verified first, loaded into the sharded model
        (every rank), at the world size of this run."""
        best = self.state.best_model_checkpoint
        if best is None:
            return
        load_training_checkpoint(
            best, model=self._sharded_model, optimizer=None, scheduler=None, verify=self._shardline_verify
        )

    def _save_optimizer_and_scheduler(self, output_dir: str, *args: Any, **kwargs: Any) -> None:
        """Nothing: the optimizer and scheduler are in the shardline checkpoint ``save_model`` wrote."""

    def _save_scaler(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the fp16 loss scaler's state is in the shardline checkpoint ``save_model`` wrote."""

    def _load_scaler(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: ``_load_optimizer_and_scheduler`` restored the loss scaler from the shardline checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, *args: Any, **kwargs: Any) -> None:
        """Only check that it is a shardline checkpoint: the model is loaded with the optimizer, later."""
        require_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None, *args: Any, **kwargs: Any) -> None:
        if checkpoint is None:
            return
        self._shardline_parent = load_training_checkpoint(
            checkpoint,
            model=self._sharded_model,
            optimizer=_inner_optimizer(self.optimizer),
            scheduler=self.lr_scheduler,
            scaler=self._shardline_scaler,
            verify=self._shardline_verify,
        )


def _inner_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (itself when not wrapped)."""
    inner: torch.optim.Optimizer | None = getattr(optimizer, "optimizer", optimizer)
    return inner


def _refuse(problems: list[str], name: str) -> None:
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigurationError(f"{name} cannot train with these TrainingArguments:\n{listed}")


_CACHE: dict[type, type] = {}


def sharded(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) on a shardline-sharded model.

    >>> from trl import SFTTrainer
    >>> trainer = shardline.hf.sharded(SFTTrainer)(model=model, args=config, train_dataset=data, peft_config=lora)

    The new class takes ``trainer_cls``'s arguments plus :class:`ShardlineTrainer`'s keywords.

    Raises:
        ConfigurationError: ``trainer_cls`` is not a Trainer subclass, or a method the
            integration overrides is missing or takes other leading parameters (a transformers
            release it does not support, or a subclass's own override).
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigurationError(f"sharded() takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, ShardlineTrainerMixin):
        return trainer_cls
    if trainer_cls is Trainer:
        return ShardlineTrainer
    cls = _CACHE.get(trainer_cls)
    if cls is None:
        check_trainer_class(trainer_cls)
        cls = type(
            f"Sharded{trainer_cls.__name__}",
            (ShardlineTrainerMixin, trainer_cls),
            {"__module__": trainer_cls.__module__, "__doc__": f"{trainer_cls.__name__} on a shardline-sharded model."},
        )
        _CACHE[trainer_cls] = cls
    return cls


class ShardlineTrainer(ShardlineTrainerMixin, Trainer):
    """``transformers.Trainer`` on a model sharded by shardline: swap the class, keep everything else.

    Takes ``Trainer``'s arguments, plus these keywords:

    Args:
        auto_wrap_policy: Which submodules become shard units: a module class, a dotted class
            path, a list of those, or a callable ``module -> bool``. Default: the classes the
            model declares in ``_no_split_modules`` (a transformers model's decoder layers).
        sharding_strategy: ``"full_shard"`` (ZeRO-3, default), ``"shard_grad_op"`` (ZeRO-2),
            ``"shard_opt"`` (ZeRO-1), ``"no_shard"`` (DDP-like), or an alias.
        mixed_precision: A ``shardline.MixedPrecision``. Default: from ``bf16``/``fp16`` (gathered
            parameters in that dtype, fp32 shards and gradient reduction), else none.
        reshard_after_forward: As for ``shardline.fully_shard`` (``None``: the strategy's default).
        verify: Checks before a checkpoint is resumed: ``"full"`` (every byte hashed against the
            manifest first), or the opt-ins ``"sizes"`` and ``"none"``.
        loss_scaling: How the fp16 loss scale starts and moves (a ``shardline.LossScaling``;
            default: ``torch.amp.GradScaler``'s values). With ``fp16=True`` the loss is scaled by
            shardline's ``ShardedGradScaler``: an overflow on any rank's gradient shard skips
            the step, and backs off the scale, on every rank.
        run_tags: ``{key: value}`` strings the run is filed under (``{"ticket": "ABC-1"}``),
            recorded in every checkpoint's manifest and attached to the runs of ``report_to``'s
            MLflow, W&B and TensorBoard, where each committed checkpoint is recorded too
            (:mod:`shardline.hf.tracking`).

    Raises:
        ConfigurationError: TrainingArguments that cannot work with sharding (``fsdp=``,
            ``deepspeed=``, ``torch_compile``...; all named in one message), or no wrap policy
            for a model that declares no ``_no_split_modules``, ``loss_scaling=`` without fp16, or a
            bad run tag.
    """
