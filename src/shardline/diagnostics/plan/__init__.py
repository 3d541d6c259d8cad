"""``shardline plan``: which strategy, micro-batch and checkpointing, predicted from FLOPs, bytes and rates.

The model shape (:mod:`.architecture`), the devices and their efficiency constants
(:mod:`.devices`), memory from the estimator (:mod:`.memory`), the time model (:mod:`.cost`), the
search (:mod:`.search`), this machine's measurement (:mod:`.calibrate`) and the output
(:mod:`.render`). ``docs/planning.md`` writes the model out and checks it against published runs.
"""

from shardline.diagnostics.plan.architecture import (
    ActivationCheckpointing,
    Architecture,
    from_gpt_config,
    load_hf_config,
)
from shardline.diagnostics.plan.calibrate import Calibration, calibrate, load_calibration
from shardline.diagnostics.plan.cost import Candidate, Cluster, Prediction, Training, predict, step_volume
from shardline.diagnostics.plan.devices import (
    DEVICES,
    EFFICIENCY,
    Device,
    DeviceClass,
    Efficiency,
    custom_device,
    get_device,
)
from shardline.diagnostics.plan.memory import MemoryBreakdown, plan_memory
from shardline.diagnostics.plan.search import candidates, search

__all__ = [
    "DEVICES",
    "EFFICIENCY",
    "ActivationCheckpointing",
    "Architecture",
    "Calibration",
    "Candidate",
    "Cluster",
    "Device",
    "DeviceClass",
    "Efficiency",
    "MemoryBreakdown",
    "Prediction",
    "Training",
    "calibrate",
    "candidates",
    "custom_device",
    "from_gpt_config",
    "get_device",
    "load_calibration",
    "load_hf_config",
    "plan_memory",
    "predict",
    "search",
    "step_volume",
]
