"""Memory of a planned configuration, from the estimator (:mod:`shardline.diagnostics.estimate`).

The estimator builds the model on fake tensors and reads the unit layout and a dry run's saved
activations. Building a 96-layer, 175B-parameter model even on fake tensors takes a while, so
the planner asks it about the same model with one block and with two, and extends every
component linearly to ``n_layers``: parameters, gradients, optimizer state and activations grow
by one block's worth per block; the gathered-unit, full-gradient and buffer peaks (one unit at a
time) do not grow at all, and the extension keeps them constant. Activations are estimated for a
micro-batch of one sequence and scaled by the micro-batch (every saved tensor has a batch
dimension). Parameters, gradients, optimizer state and buffers are asked for once per strategy (on a
one-token sequence: they do not depend on it), activations once per checkpointing mode (they do not
depend on the strategy).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from shardline.diagnostics.estimate import MemoryEstimate, estimate_memory
from shardline.diagnostics.plan.architecture import ActivationCheckpointing, Architecture
from shardline.diagnostics.plan.proxy import ProxyBlock, ProxyDecoder, ProxyMLP
from shardline.engine import MixedPrecision, ShardingStrategy

__all__ = ["MemoryBreakdown", "plan_memory"]

_STATE_FIELDS = ("sharded_params", "sharded_grads", "optimizer_state", "unsharded_params", "unsharded_grads",
                 "comm_buffers")  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Predicted bytes per rank: held between steps, a step's transients, and activations."""

    steady: int
    transient: int
    activations: int

    @property
    def peak(self) -> int:
        """Everything at once: the step's peak."""
        return self.steady + self.transient + self.activations


def _builder(arch: Architecture) -> tuple[Callable[[int], nn.Module], type, type]:
    if arch.shardline_gpt:
        from shardline.models.gpt import GPT, MLP, Block, GPTConfig

        def gpt(n: int) -> nn.Module:
            return GPT(GPTConfig(vocab_size=arch.vocab_size, seq_len=arch.max_positions, dim=arch.dim, n_layers=n,
                                 n_heads=arch.n_heads, mlp_ratio=arch.ffn_dim // arch.dim,
                                 tie_embeddings=arch.tied_embeddings))  # fmt: skip

        return gpt, Block, MLP
    return (lambda n: ProxyDecoder(arch, n_layers=n)), ProxyBlock, ProxyMLP


@functools.lru_cache(maxsize=256)
def _estimate(
    arch: Architecture,
    n_layers: int,
    strategy: ShardingStrategy,
    world_size: int,
    shard_size: int | None,
    reshard_after_forward: bool | int | None,
    ac: ActivationCheckpointing,
    seq_len: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    in_place_gathers: bool,
) -> MemoryEstimate:
    build, block, mlp = _builder(arch)
    checkpointing = {ActivationCheckpointing.FULL: block, ActivationCheckpointing.SELECTIVE: mlp}.get(ac)
    cast = param_dtype != torch.float32 or reduce_dtype != torch.float32
    return estimate_memory(
        lambda: build(n_layers),
        policy=lambda m: isinstance(m, block),
        strategy=strategy,
        world_size=world_size,
        micro_batch_size=1,
        seq_len=seq_len,
        mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype) if cast else None,
        checkpointing_policy=(lambda m: isinstance(m, checkpointing)) if checkpointing else None,
        shard_size=shard_size,
        reshard_after_forward=reshard_after_forward,
        in_place_gathers=in_place_gathers,
    )


def plan_memory(
    arch: Architecture,
    *,
    strategy: ShardingStrategy,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    ac: ActivationCheckpointing,
    shard_size: int | None = None,
    reshard_after_forward: bool | int | None = None,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    in_place_gathers: bool = False,
) -> MemoryBreakdown:
    """One rank's memory for ``arch`` trained as described, extended from one- and two-block estimates."""
    # Parameters, gradients, optimizer state and buffers do not depend on the sequence or on
    # checkpointing, and activations do not depend on the strategy: two cached questions, not one
    # per combination (a dry run over a long sequence is the slow part).
    dtypes = (param_dtype, reduce_dtype, in_place_gathers)
    state_args = (strategy, world_size, shard_size, reshard_after_forward, ActivationCheckpointing.NONE, 1, *dtypes)
    act_args = (ShardingStrategy.NO_SHARD, 1, None, None, ac, seq_len, *dtypes)
    layers = (1, min(2, arch.n_layers))
    states = [_estimate(arch, n, *state_args) for n in layers]
    acts = [_estimate(arch, n, *act_args) for n in layers]
    extra = arch.n_layers - 1

    def extend(pair: list[MemoryEstimate], field: str) -> int:
        a: int = getattr(pair[0], field)
        b: int = getattr(pair[1], field)
        return a + extra * (b - a)

    state = {f: extend(states, f) for f in _STATE_FIELDS}
    return MemoryBreakdown(
        steady=state["sharded_params"] + state["sharded_grads"] + state["optimizer_state"],
        transient=state["unsharded_params"] + state["unsharded_grads"] + state["comm_buffers"],
        activations=micro_batch * extend(acts, "activations"),
    )
