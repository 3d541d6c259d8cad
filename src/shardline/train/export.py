"""The ``Export`` callback: consolidate the run's last checkpoint when training ends.

``callbacks.export: {_target_: shardline.train.export.Export, adapters: true}`` writes, on rank
0 after the last checkpoint is committed, ``RUN_DIR/export/model`` (the model as safetensors,
with ``config.json`` for a transformers model; the base model of a PEFT model) and, with
``adapters``, ``RUN_DIR/export/adapter`` (``PeftModel.from_pretrained`` loads it). It is
exactly ``shardline consolidate`` of that checkpoint, so each folder carries the checkpoint's
manifest hash in its ``consolidation.json``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.consolidate import consolidate
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
            result = consolidate(last.path, out, dtype=self.dtype, verify=VerifyLevel.FULL, adapters=adapters)
            log.info("exported the %s of step %d to %s (%d tensors)", name, last.step, out, result.tensors)
            print(f"exported the {name} of step {last.step} to {out} ({result.tensors} tensors)", flush=True)
