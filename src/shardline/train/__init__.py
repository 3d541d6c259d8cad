"""``shardline train``: configs, launching, the training loop, data and callbacks."""

from shardline.train.config import compose_config, validate
from shardline.train.launcher import train
from shardline.train.trainer import StepMetrics, Summary, Trainer

__all__ = ["StepMetrics", "Summary", "Trainer", "compose_config", "train", "validate"]
