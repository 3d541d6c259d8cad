"""Text summaries of a sharded model: what was resolved, what each rank holds, what smells wrong.

Pure functions returning lines of text, so the training callback, tests and users can all use
them. Three smells are called out because they are the most common FSDP failures:

* the wrap policy matched (almost) nothing, so one unit holds most parameters and nothing is
  really sharded per layer;
* the dtype configuration did not apply as intended (``trainer.precision`` and the strategy's
  ``mixed_precision`` disagree);
* one phase of a step explodes in memory (see the per-phase table).
"""

from __future__ import annotations

import resource
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardline.engine import CollectiveRecord, MixedPrecision, ShardUnit, is_checkpointed, original_class

__all__ = [
    "PhaseMemory",
    "comm_table",
    "peak_rss_bytes",
    "policy_summary",
    "precision_summary",
    "rank_summary",
    "reset_peak_rss",
    "unit_summary",
]

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _dtype(d: torch.dtype | None, default: str) -> str:
    return str(d).replace("torch.", "") if d is not None else default


def _after_forward(u: ShardUnit) -> str:
    """What the unit does with its parameters after forward, and over which ranks it shards."""
    mesh = f" (shard {u.mesh.shard_size} x replicate {u.mesh.replicate_size})" if u.mesh.is_hybrid else ""
    if not u.policy.shard_params:
        kept = "optimizer state sharded" if u.policy.shard_optimizer else "replicated"
        return f"keeps full parameters ({kept}){mesh}"
    if u.post_forward_size is not None:
        return f"keeps gathered parameters split over {u.post_forward_size} ranks after forward{mesh}"
    return f"{'frees' if u.reshard_after_forward else 'keeps'} gathered parameters after forward{mesh}"


def unit_summary(units: Sequence[ShardUnit], world_size: int) -> list[str]:
    """One line per group of identically configured units (strategy, reshard policy, precision)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for u in units:
        mp = u.mixed_precision
        key = (
            u.strategy.value,
            _after_forward(u),
            _dtype(mp.param_dtype, "as stored"),
            "+".join(_dtype(mp.gradient_reduce_dtype(d), "") for d in u.dtypes) or "none",
            u.forward_prefetch,
            u.backward_prefetch,
        )
        groups.setdefault(key, []).append(u.display_name)
    lines = [f"{len(units)} units over {world_size} ranks"]
    for (strategy, reshard, param, reduce, fwd, bwd), names in groups.items():
        shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} units)"
        lines.append(
            f"  {shown}: {strategy}, {reshard}, "
            f"param dtype {param}, reduce dtype {reduce}, prefetch forward={'on' if fwd else 'off'} "
            f"backward={bwd or 'off'}"
        )
    return lines


def precision_summary(precision: str, mixed_precision: MixedPrecision | None) -> tuple[list[str], list[str]]:
    """What ``trainer.precision`` and the applied ``mixed_precision`` mean together; warnings when they disagree."""
    mp = mixed_precision or MixedPrecision()
    autocast = "bf16" if precision == "bf16-mixed" else None
    lines = [
        f"mixed precision applied: parameters gathered in {_dtype(mp.param_dtype, 'their own dtype')}, "
        f"gradients reduced in {_dtype(mp.gradient_reduce_dtype(torch.float32), 'fp32')}, "
        f"buffers in {_dtype(mp.buffer_dtype, 'their own dtype')}",
        f"trainer.precision={precision}: " + ("autocast to bf16 around forward" if autocast else "no autocast"),
    ]
    warnings = []
    if autocast and mp.param_dtype is None:
        warnings.append(
            "trainer.precision=bf16-mixed autocasts ops to bf16, but no trainer.strategy.mixed_precision is set: "
            "parameters are gathered and gradients reduced in fp32, so communication is not halved. Set "
            "trainer.strategy.mixed_precision={_target_: shardline.train.precision.bf16_mixed_precision} to "
            "gather in bf16."
        )
    if not autocast and mp.param_dtype is not None and mp.param_dtype != torch.float32:
        warnings.append(
            f"trainer.precision={precision} asks for full precision, but trainer.strategy.mixed_precision "
            f"computes in {_dtype(mp.param_dtype, '')}: mixed_precision decides parameter dtypes, so compute is "
            f"{_dtype(mp.param_dtype, '')}. Remove mixed_precision for fp32 compute, or set "
            "trainer.precision=bf16-mixed to say what you get."
        )
    return lines, warnings


def policy_summary(
    model: nn.Module,
    units: Sequence[ShardUnit],
    wrap: Callable[[nn.Module], bool] | None,
    checkpointing: Callable[[nn.Module], bool] | None,
) -> list[str]:
    """Which classes the wrap and activation-checkpointing policies matched."""
    wrapped = Counter(original_class(u.module).__name__ for u in units if not u.is_root)
    checkpointed = Counter(type(m).__name__ for m in model.modules() if is_checkpointed(m))
    lines = []
    if wrap is None:
        lines.append("wrap policy: none (the whole model is one unit)")
    else:
        matched = ", ".join(f"{n} x {c}" for c, n in wrapped.items()) or "nothing"
        lines.append(f"wrap policy {wrap!r} matched {sum(wrapped.values())} modules: {matched}")
    if checkpointing is None:
        lines.append("activation checkpointing: off")
    else:
        matched = ", ".join(f"{n} x {c}" for c, n in checkpointed.items()) or "nothing"
        lines.append(f"activation checkpointing {checkpointing!r} on {sum(checkpointed.values())} modules: {matched}")
    return lines


def rank_summary(
    rank: int,
    world_size: int,
    model: nn.Module,
    units: Sequence[ShardUnit],
    *,
    dominant_fraction: float = 0.5,
    uneven_tolerance: float = 0.25,
) -> tuple[list[str], list[str]]:
    """This rank's share after wrapping, and warnings for uneven shards or a unit that holds most parameters."""
    local = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    total = sum(sp.layout.numel for u in units for sp in u.params if sp.sharded.requires_grad)
    element = next((p.element_size() for p in model.parameters()), 4)
    checkpointed = sum(1 for m in model.modules() if is_checkpointed(m))
    lines = [
        f"[rank {rank}] {len(units)} units, {checkpointed} activation-checkpointed modules, "
        f"{_mib(local)} of trainable parameters on this rank (of {_mib(total * element)} in the model)"
    ]
    warnings = []
    even = sum(sp.layout.numel / u.mesh.shard_size for u in units if u.mesh.shard_size > 1 for sp in u.params)
    sharded_local = sum(sp.layout.local_numel for u in units if u.mesh.shard_size > 1 for sp in u.params)
    if even and world_size > 1:
        share = sharded_local / even
        if abs(share - 1) > uneven_tolerance:
            warnings.append(
                f"[rank {rank}] holds {share:.2f}x its even share of the sharded parameters: dim-0 sizes not "
                f"divisible by the shard group size leave uneven torch.chunk shards (and padding costs communication)"
            )
    all_params = sum(sp.layout.numel for u in units for sp in u.params)
    if len(units) > 0 and all_params:
        biggest = max(units, key=lambda u: sum(sp.layout.numel for sp in u.params))
        fraction = sum(sp.layout.numel for sp in biggest.params) / all_params
        if fraction > dominant_fraction and (len(units) > 1 or biggest.mesh.shard_size > 1):
            warnings.append(
                f"[rank {rank}] unit '{biggest.display_name}' holds {fraction:.0%} of all parameters: the wrap "
                "policy matched almost nothing, so that unit is gathered whole and memory barely drops with more "
                "ranks. Pass the class of the model's repeated blocks to layer_policy()."
            )
    return lines, warnings


def comm_table(records: Sequence[CollectiveRecord]) -> list[str]:
    """Collectives of a step grouped by kind, unit and phase: count and bytes (logical and per-rank wire)."""
    groups: dict[tuple[str, str, str], list[CollectiveRecord]] = {}
    for r in records:
        groups.setdefault((r.kind.value, r.unit or "-", r.phase or "-"), []).append(r)
    total, wire = sum(r.bytes for r in records), sum(r.wire_bytes for r in records)
    lines = [f"collectives in one step: {len(records)}, {_mib(total)} ({_mib(wire)} on the wire)"]
    for (kind, unit, phase), rs in groups.items():
        lines.append(
            f"  {kind:<14} {unit:<14} {phase:<10} x{len(rs):<3} {_mib(sum(r.bytes for r in rs)):>12} "
            f"({rs[0].dtype})".replace("torch.", "")
        )
    return lines


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS measurement (Linux ``clear_refs``); False if not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the last :func:`reset_peak_rss` (or process start)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class PhaseMemory:
    """Memory at the end of one phase of a step, and its peak during that phase."""

    step: int
    phase: str
    engine_bytes: int
    engine_peak_bytes: int
    peak_rss_bytes: int
    cuda_peak_bytes: int | None

    def line(self) -> str:
        cuda = f"  cuda peak {_mib(self.cuda_peak_bytes)}" if self.cuda_peak_bytes is not None else ""
        return (
            f"step {self.step:>3} {self.phase:<22} engine {_mib(self.engine_bytes):>12} "
            f"(peak {_mib(self.engine_peak_bytes):>12})  process peak RSS {_mib(self.peak_rss_bytes):>12}{cuda}"
        )
