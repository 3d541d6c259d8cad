"""What ``ShardlineTrainer`` decides before sharding: the wrap policy, mixed precision, refused arguments.

Note: why these checks run at construction. Trainer and Accelerate act on several arguments
only inside ``train()`` (``fsdp=``, ``deepspeed=``, ``torch_compile``): found there, they would fail after the data and
model were set up, or -- worse -- wrap the sharded model a second time. Every argument that
cannot work with a shardline-sharded model is collected here and reported in one error when
the trainer is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardline.engine import MixedPrecision, layer_policy, original_class
from shardline.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["refused_arguments", "resolve_mixed_precision", "resolve_wrap_policy"]

WrapPolicyLike = Callable[[nn.Module], bool] | type | str | Iterable[type | str] | None


def _declared_blocks(model: nn.Module) -> list[str]:
    """The ``_no_split_modules`` of the first transformers model inside ``model`` (a PEFT model's base model)."""
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return [str(n) for n in names]
    return []


def resolve_wrap_policy(model: nn.Module, policy: WrapPolicyLike) -> Callable[[nn.Module], bool]:
    """Which submodules of ``model`` become shard units.

    ``policy``: a callable ``module -> bool``, a module class, a dotted class path, or a list of
    those; ``None`` takes the classes the model declares in ``_no_split_modules`` (the decoder
    layers transformers keeps whole).

    Raises:
        ConfigurationError: ``policy`` of another type, or ``None`` for a model declaring no
            ``_no_split_modules`` (or declaring classes it does not contain).
    """
    if policy is not None:
        if isinstance(policy, (str, type)):
            return layer_policy(policy)
        if callable(policy):
            return policy
        if isinstance(policy, Iterable):
            items = list(policy)
            if items and all(isinstance(v, (str, type)) for v in items):
                return layer_policy(*items)
        raise ConfigurationError(
            "auto_wrap_policy must be a module class, a dotted class path, a list of those, or a callable "
            f"module -> bool; got {type(policy).__name__}: {policy!r}"
        )
    declared = _declared_blocks(model)
    classes = {type(m).__name__: original_class(m) for m in model.modules()}
    found = [classes[name] for name in declared if name in classes]
    if not found:
        what = (
            f"declares _no_split_modules={declared}, none of which it contains"
            if declared
            else "declares no _no_split_modules (the blocks transformers keeps whole)"
        )
        raise ConfigurationError(
            f"ShardlineTrainer cannot tell which layers of {original_class(model).__name__} to shard: the model "
            f"{what}. Pass auto_wrap_policy= the class of its repeated blocks (a class, a dotted class path or a "
            f"list of those). Its module classes are: {', '.join(sorted(classes))}."
        )
    return layer_policy(*found)


def resolve_mixed_precision(args: TrainingArguments, given: MixedPrecision | None) -> MixedPrecision | None:
    """shardline's mixed precision for Trainer's ``bf16`` / ``fp16`` (``given`` wins when set).

    ``bf16=True`` gathers parameters and computes in bf16 while shards, optimizer state and the
    gradient reduction stay fp32 (``reduce_dtype=float32``), as Trainer's autocast keeps fp32
    weights and DDP reduces fp32 gradients; likewise fp16.
    """
    if given is not None:
        if not isinstance(given, MixedPrecision):
            raise ConfigurationError(
                f"mixed_precision must be a shardline.MixedPrecision or None, got {type(given).__name__}"
            )
        return given
    if getattr(args, "bf16", False):
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if getattr(args, "fp16", False):
        return MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return None


def refused_arguments(args: TrainingArguments) -> list[str]:
    """Each TrainingArguments setting that cannot work on a shardline-sharded model, with its fix."""
    problems = []
    if getattr(args, "fsdp", None):
        problems.append(
            f"fsdp={args.fsdp!r}: shardline already shards the model (FSDP would shard it a second time); remove "
            "fsdp= and fsdp_config=, and choose the strategy with ShardlineTrainer(sharding_strategy=...). To keep "
            "Trainer's own FSDP, use transformers.Trainer with callbacks=[shardline.hf.LineageCallback()]: its "
            "checkpoints are adopted at each save and verified before a resume (docs/foreign-engines.md)"
        )
    if getattr(args, "deepspeed", None):
        problems.append(
            "deepspeed= is set: DeepSpeed ZeRO and shardline both shard the model; remove deepspeed= "
            "(sharding_strategy='shard_grad_op' is ZeRO-2, 'full_shard' ZeRO-3)"
        )
    if getattr(args, "torch_compile", False):
        problems.append(
            "torch_compile=True: compiling the whole sharded model through Trainer is not supported by "
            "ShardlineTrainer yet; remove torch_compile"
        )
    if getattr(args, "push_to_hub", False):
        problems.append(
            "push_to_hub=True: ShardlineTrainer writes checkpoints and save_model() output locally only; remove "
            "push_to_hub and upload the folder save_model() wrote (huggingface_hub.upload_folder)"
        )
    if getattr(args, "parallelism_config", None) is not None:
        problems.append(
            "parallelism_config= is set: ShardlineTrainer shards over one data-parallel dimension (no tensor, "
            "context or sequence parallelism); remove it"
        )
    if getattr(args, "n_gpu", 0) > 1:
        problems.append(
            f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): launch one process per GPU with torchrun "
            "or accelerate launch"
        )
    return problems
