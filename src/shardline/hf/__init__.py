"""shardline for Hugging Face ``Trainer`` and TRL (``pip install 'shardline[hf]'``).

``ShardlineTrainer`` is a ``transformers.Trainer`` whose model is sharded by shardline;
``sharded(TrainerCls)`` gives any Trainer subclass (TRL's ``SFTTrainer``, ``DPOTrainer``) the
same behaviour. See docs/hf_trainer.md. ``LineageCallback`` is for a Trainer that keeps its own
FSDP (``fsdp=``): its checkpoints adopted at each save, verified before a resume.
"""

from shardline.hf.diagnostics import DiagnosticsCallback
from shardline.hf.lineage import LineageCallback
from shardline.hf.options import resolve_mixed_precision, resolve_wrap_policy
from shardline.hf.trainer import ShardlineTrainer, ShardlineTrainerMixin, sharded

__all__ = [
    "DiagnosticsCallback",
    "LineageCallback",
    "ShardlineTrainer",
    "ShardlineTrainerMixin",
    "resolve_mixed_precision",
    "resolve_wrap_policy",
    "sharded",
]
