"""Hugging Face and PEFT metadata: recorded at save, turned into ``config.json`` / ``adapter_config.json`` on export.

At save (:func:`hf_metadata`), a ``transformers`` model -- or the base model of a ``peft``
model -- contributes its config (``hf_config``), its generation config when it generates
(``hf_generation_config``), and a PEFT model its adapter configs (``peft_config``, by adapter
name), all as plain JSON data in the checkpoint's trainer state. Nothing is recorded for other
models, and nothing a caller passed under those keys is overwritten.

At export (:func:`export_layout`), a checkpoint's tensors are selected and renamed:

* a transformers model: every tensor under its own name, plus ``config.json`` (and
  ``generation_config.json``), so ``AutoModelForCausalLM.from_pretrained(out)`` loads it;
* a PEFT model, default: the **base model** in transformers' layout (``base_model.model.``
  dropped, ``.base_layer`` unwrapped, the frozen ``original_module`` of each
  ``modules_to_save`` wrapper) with its ``config.json`` -- the adapters are left out;
* a PEFT model with ``adapters=True``: the adapter in PEFT's saved layout
  (``adapter_model.safetensors`` with the adapter name removed from each key, and
  ``adapter_config.json``), so ``PeftModel.from_pretrained(base, out)`` loads it.

Note: which PEFT adapters are exported. LoRA (``peft_type`` ``LORA``) with ``bias="none"``
and without DoRA, one adapter per model, optionally with ``modules_to_save``; anything else is
refused with the ``save_pretrained`` route as the alternative (docs/huggingface.md). The key
names follow PEFT's documented convention (``...q_proj.lora_A.default.weight`` is saved as
``...q_proj.lora_A.weight``); the tests check them against PEFT's own ``save_pretrained``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torch import nn

from shardline.engine import original_class
from shardline.errors import ConfigurationError

__all__ = ["HF_CONFIG", "HF_GENERATION_CONFIG", "PEFT_CONFIG", "ExportLayout", "export_layout", "hf_metadata"]

HF_CONFIG = "hf_config"
HF_GENERATION_CONFIG = "hf_generation_config"
PEFT_CONFIG = "peft_config"
PEFT_PREFIX = "base_model.model."
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def _plain(value: Any) -> Any:
    """JSON data only: sets become sorted lists, enums their values."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _config_dict(config: Any) -> dict[str, Any] | None:
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    parsed: dict[str, Any] = json.loads(to_json(use_diff=False))  # a config's JSON is an object
    return parsed


def hf_metadata(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint records about a transformers / PEFT model (empty for any other model)."""
    peft: object = getattr(model, "peft_config", None)
    base = (
        model.get_base_model()  # type: ignore[operator]  # a PEFT model's method; nn.Module types attributes as Tensor
        if isinstance(peft, Mapping) and hasattr(model, "get_base_model")
        else model
    )
    config = _config_dict(getattr(base, "config", None))
    if config is None or "model_type" not in config:
        return {}
    if not config.get("architectures"):
        config["architectures"] = [original_class(base).__name__]
    out: dict[str, Any] = {HF_CONFIG: config}
    can_generate = getattr(base, "can_generate", None)
    generation = getattr(base, "generation_config", None)
    if generation is not None and callable(can_generate) and can_generate():
        out[HF_GENERATION_CONFIG] = _config_dict(generation)
    if isinstance(peft, Mapping):
        out[PEFT_CONFIG] = {str(name): _plain(cfg.to_dict()) for name, cfg in peft.items()}
    return out


@dataclass(frozen=True)
class ExportLayout:
    """How a checkpoint's tensors are written: which, under what names, with which files beside them."""

    names: dict[str, str]
    weights_name: str = "model"
    extra_files: dict[str, bytes] = field(default_factory=dict)
    note: str | None = None


def _json_file(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _hf_files(state: Mapping[str, Any]) -> dict[str, bytes]:
    files = {}
    if state.get(HF_CONFIG) is not None:
        files["config.json"] = _json_file(state[HF_CONFIG])
    if state.get(HF_GENERATION_CONFIG) is not None:
        files["generation_config.json"] = _json_file(state[HF_GENERATION_CONFIG])
    return files


def _lora_adapter(peft: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if len(peft) != 1:
        raise ConfigurationError(
            f"the checkpoint's PEFT model has {len(peft)} adapters ({', '.join(sorted(peft))}); --adapters exports a "
            "model with one adapter. Save the others with PeftModel.save_pretrained (see docs/huggingface.md)."
        )
    ((name, config),) = peft.items()
    kind = str(config.get("peft_type", "")).upper()
    unsupported = []
    if kind != "LORA":
        unsupported.append(f"peft_type {config.get('peft_type')!r} (only LoRA is exported)")
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config.get('bias')!r}")
    if config.get("use_dora"):
        unsupported.append("use_dora=True")
    if unsupported:
        raise ConfigurationError(
            f"cannot export the PEFT adapter {name!r}: {', '.join(unsupported)}. shardline exports LoRA adapters "
            "without bias or DoRA; for others gather the state dict and call PeftModel.save_pretrained "
            "(docs/huggingface.md)."
        )
    return name, config


def _adapter_key(key: str, adapter: str) -> str | None:
    """PEFT's saved name of an adapter tensor (adapter name removed), or None if ``key`` is not one."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _LORA_PARTS and parts[i + 1] == adapter:
            return ".".join(parts[: i + 1] + parts[i + 2 :])
        if part == "modules_to_save" and parts[i + 1] == adapter:
            return ".".join(parts[:i] + parts[i + 2 :])
    return None


def _base_key(key: str) -> str | None:
    """The transformers name of a base-model tensor of a PEFT model, or None for adapter tensors."""
    parts = key.split(".")
    if any(p in _LORA_PARTS or p in ("lora_magnitude_vector", "modules_to_save") for p in parts):
        return None
    parts = [p for p in parts if p not in ("base_layer", "original_module")]
    return ".".join(parts).removeprefix(PEFT_PREFIX)


def export_layout(names: Mapping[str, str], state: Mapping[str, Any], *, adapters: bool) -> ExportLayout:
    """Which stored tensors to write under which names (``names``: stored key -> name after prefix stripping).

    Raises:
        ConfigurationError: ``adapters`` for a checkpoint without PEFT adapters, or adapters of a
            kind shardline does not export.
    """
    peft = state.get(PEFT_CONFIG)
    if not peft:
        if adapters:
            what = "a transformers model" if state.get(HF_CONFIG) else "a model"
            raise ConfigurationError(
                f"--adapters exports PEFT adapters, but this checkpoint holds {what} without any; export the "
                "whole model without --adapters"
            )
        return ExportLayout(names=dict(names), extra_files=_hf_files(state))
    adapter, config = _lora_adapter(peft)
    if adapters:
        selected = {key: _adapter_key(exported, adapter) for key, exported in names.items()}
        kept = {key: name for key, name in selected.items() if name is not None}
        if not kept:
            raise ConfigurationError(f"the checkpoint has no tensors of the PEFT adapter {adapter!r}")
        adapter_config = {**config, "inference_mode": True}
        return ExportLayout(
            names=kept,
            weights_name="adapter_model",
            extra_files={"adapter_config.json": _json_file(adapter_config)},
        )
    selected = {key: _base_key(exported) for key, exported in names.items()}
    kept = {key: name for key, name in selected.items() if name is not None}
    left = len(selected) - len(kept)
    return ExportLayout(
        names=kept,
        extra_files=_hf_files(state),
        note=(
            f"PEFT checkpoint: wrote the base model; its {left} adapter tensor(s) were left out -- export them with "
            "--adapters"
        ),
    )
