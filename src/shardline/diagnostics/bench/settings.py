"""What ``shardline bench`` runs: the model sizes and the settings (shared by the benchmark and its results)."""

from __future__ import annotations

import dataclasses

from shardline.errors import ConfigurationError
from shardline.models.gpt import GPTConfig

__all__ = ["HYBRID_MESH", "HYBRID_RUN", "MAIN_RUN", "SIZES", "W1_RUN", "BenchSettings", "ModelSize"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSize:
    """A :class:`~shardline.models.GPT` shape to benchmark."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int = 128
    vocab_size: int = 256

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size, seq_len=self.seq_len, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads
        )

    @property
    def num_params(self) -> int:
        return self.gpt_config().num_params

    def describe(self) -> str:
        return f"GPT dim={self.dim}, {self.n_layers} layers, {self.n_heads} heads, {self.num_params / 1e6:.2f} M params"


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(name="tiny", dim=32, n_layers=2, n_heads=2, seq_len=16),
    "default": ModelSize(name="default", dim=128, n_layers=4, n_heads=4, seq_len=128),
    "10x": ModelSize(name="10x", dim=320, n_layers=7, n_heads=10, seq_len=128),
    "101m": ModelSize(name="101m", dim=1024, n_layers=8, n_heads=16, seq_len=128),
}

# The runs, by configuration key (``shardline.diagnostics.bench.run.CONFIGS`` defines each key).
MAIN_RUN: tuple[str, ...] = (
    "shardline_full_shard",
    "shardline_shard_grad_op",
    "shardline_no_shard",
    "shardline_shard_opt",
    "torch_fsdp2",
    "torch_ddp",
    "one_process",
)
"""The main run at ``world_size`` ranks (``--configs`` picks among these)."""
HYBRID_RUN: tuple[str, ...] = ("shardline_hybrid_shard", "torch_fsdp2_hsdp")
"""shardline HYBRID_SHARD against FSDP2's HSDP on a :data:`HYBRID_MESH` mesh."""
HYBRID_MESH = (2, 2)
"""(replicate, shard) of the hybrid run."""
W1_RUN: tuple[str, ...] = ("plain", "shardline_full_shard")
"""shardline FULL_SHARD at one rank against the plain model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What to run. The defaults produce the results committed under ``docs/benchmarks/``.

    Attributes:
        sizes: Model sizes; each gets its own runs.
        world_size: Ranks of the main run (the W=1 comparison has its own one-rank run).
        micro_batch: Sequences per rank per step; one process gets ``world_size`` times as many.
        steps: Consecutive steps of one configuration within a timing round.
        rounds: Timing rounds; each runs every configuration, in an order rotated by one.
        warmup: Untimed steps per configuration before timing (and before the memory steps).
        memory_steps: Steps whose peak RSS is measured in each configuration's probe run.
        seed: Seed of the initial weights (all configurations) and of the batch.
        lr: AdamW learning rate.
        w1: Also compare shardline FULL_SHARD at W=1 with the plain model.
        hybrid: Also compare shardline HYBRID_SHARD with FSDP2's HSDP at 4 ranks on a 2x2 mesh.
        configs: The main run's configurations (keys of :data:`MAIN_RUN`); empty: all of them.
        timeout_s: Hard deadline of each process group.
    """

    sizes: tuple[ModelSize, ...] = (SIZES["default"], SIZES["10x"])
    world_size: int = 2
    micro_batch: int = 8
    steps: int = 2
    rounds: int = 5
    warmup: int = 2
    memory_steps: int = 2
    seed: int = 0
    lr: float = 3e-4
    w1: bool = True
    hybrid: bool = True
    configs: tuple[str, ...] = ()
    timeout_s: float = 1800.0

    @property
    def main_configs(self) -> tuple[str, ...]:
        """The main run's configurations, in :data:`MAIN_RUN` order."""
        return tuple(k for k in MAIN_RUN if not self.configs or k in self.configs)

    def validate(self) -> None:
        """Raise :class:`ConfigurationError` naming the first bad value and the fix."""
        if not self.sizes:
            raise ConfigurationError(f"no model size to benchmark; pick some of {sorted(SIZES)}")
        names = [s.name for s in self.sizes]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"model sizes must have distinct names, got {names}")
        for size in self.sizes:
            try:
                size.gpt_config()
            except ValueError as exc:
                raise ConfigurationError(f"model size {size.name!r}: {exc}") from exc
        for name, value, least in (
            ("world_size", self.world_size, 2),
            ("micro_batch", self.micro_batch, 1),
            ("steps", self.steps, 1),
            ("rounds", self.rounds, 1),
            ("warmup", self.warmup, 1),
            ("memory_steps", self.memory_steps, 1),
        ):
            if not isinstance(value, int) or value < least:
                extra = " (W=1 is measured separately, see w1)" if name == "world_size" else ""
                raise ConfigurationError(f"{name} must be an integer >= {least}{extra}, got {value!r}")
        unknown = [k for k in self.configs if k not in MAIN_RUN]
        if unknown:
            raise ConfigurationError(f"unknown configuration(s) {unknown}; choose among {list(MAIN_RUN)}")
        if not self.lr > 0 or not self.timeout_s > 0:
            raise ConfigurationError(f"lr and timeout_s must be positive, got lr={self.lr}, timeout_s={self.timeout_s}")
