"""The engine benchmark (``shardline bench``): the run (:mod:`.run`), its settings and model sizes
(:mod:`.settings`), the communication theory it is checked against (:mod:`.theory`), the recorded
results (:mod:`.results`) and their tables and chart (:mod:`.render`)."""

from shardline.diagnostics.bench.results import (
    BenchResult,
    CommVolume,
    ConfigResult,
    RankMemory,
    RunResult,
    Spread,
    Target,
    evaluate_targets,
)
from shardline.diagnostics.bench.run import CONFIGS, Configuration, run_benchmark
from shardline.diagnostics.bench.settings import HYBRID_MESH, HYBRID_RUN, MAIN_RUN, SIZES, BenchSettings, ModelSize
from shardline.diagnostics.bench.theory import fsdp2_theory, issued_on_gloo, shardline_theory

__all__ = [
    "CONFIGS",
    "HYBRID_MESH",
    "HYBRID_RUN",
    "MAIN_RUN",
    "SIZES",
    "BenchResult",
    "BenchSettings",
    "CommVolume",
    "ConfigResult",
    "Configuration",
    "ModelSize",
    "RankMemory",
    "RunResult",
    "Spread",
    "Target",
    "evaluate_targets",
    "fsdp2_theory",
    "issued_on_gloo",
    "run_benchmark",
    "shardline_theory",
]
