"""The ``Export`` callback: consolidate the run's last checkpoint when training ends.

``callbacks.export: {_target_: shardline.train.export.Export, adapters: true}`` writes, on rank
0 after the last checkpoint is committed, ``RUN_DIR/export/model`` (the model as safetensors,
with ``config.json`` for a transformers model; the base model of a PEFT model) and, with
``adapters``, ``RUN_DIR/export/adapter`` (``PeftModel.from_pretrained`` loads it). It is
exactly ``shardline consolidate`` of that checkpoint, so each folder carries the checkpoint's
manifest hash in its ``consolidation.json``.

A resumed run finds its earlier export in place. Exports never overwrite, so: a folder that
already holds this very checkpoint (its ``consolidation.json`` names the same manifest hash) is
kept as it is; any other is moved aside to ``<name>-step-<its step>`` (``<name>-previous`` when
it records none) and the new export takes the name.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.consolidate import SIDECAR, consolidate
from shardline.train.callbacks import Callback

if TYPE_CHECKING:
    from shardline.train.trainer import Summary, Trainer

__all__ = ["Export"]

log = logging.getLogger("shardline.train")


class Export(Callback):
    """Consolidate the last checkpoint into ``RUN_DIR/<folder>/model`` (and ``.../adapter``) at the end of training.

    Args:
        folder: Where, inside the run directory.
        model: Export the model (for a PEFT model: its base model).
        adapters: Export the PEFT adapter too.
        dtype: Cast floating-point weights (``bf16``, ``fp16``, ``fp32``); ``None`` keeps them.
    """

    def __init__(
        self, *, folder: str = "export", model: bool = True, adapters: bool = False, dtype: str | None = None
    ) -> None:
        self.folder, self.model, self.adapters, self.dtype = folder, model, adapters, dtype

    def on_fit_end(self, trainer: Trainer, summary: Summary) -> None:
        if not trainer.is_rank0:
            return
        last = trainer.checkpoints.manager.wait()
        if last is None:
            log.warning("export: no checkpoint was saved in this run (checkpoint.save_last=false?); nothing exported")
            return
        for name, adapters, wanted in (("model", False, self.model), ("adapter", True, self.adapters)):
            if not wanted:
                continue
            out = trainer.run_dir / self.folder / name
            if _already_exported(out, last.manifest_hash):
                log.info("export: %s already holds step %d (manifest %s); kept", out, last.step, last.manifest_hash)
                continue
            _move_aside(out)
            result = consolidate(last.path, out, dtype=self.dtype, verify=VerifyLevel.FULL, adapters=adapters)
            log.info("exported the %s of step %d to %s (%d tensors)", name, last.step, out, result.tensors)
            print(f"exported the {name} of step {last.step} to {out} ({result.tensors} tensors)", flush=True)


def _recorded_source(out: Path) -> dict[str, object] | None:
    try:
        source = json.loads((out / SIDECAR).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, dict) else None


def _already_exported(out: Path, manifest_hash: str) -> bool:
    source = _recorded_source(out)
    return source is not None and source.get("manifest_sha256") == manifest_hash


def _move_aside(out: Path) -> None:
    """Move an earlier, non-empty export out of the way, under a name that says which step it holds."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    step = (_recorded_source(out) or {}).get("step")
    base = f"{out.name}-step-{step}" if isinstance(step, int) else f"{out.name}-previous"
    target, n = out.with_name(base), 1
    while target.exists() or target.is_symlink():
        n += 1
        target = out.with_name(f"{base}.{n}")
    out.rename(target)
    log.warning("export: %s held an earlier export; moved it to %s", out, target)
    print(f"moved the earlier export {out} to {target}", flush=True)
