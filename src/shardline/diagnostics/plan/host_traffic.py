"""The engine's own memory traffic per step on CPU (gloo): what it copies, zeroes and allocates anew.

Counted from the engine's code paths on gloo (``engine/flat.py``, ``engine/flat_grads.py``,
``engine/pending.py``, ``engine/comm.py``), per micro-batch, for ``Psi`` parameters (``P_u`` in
the largest unit), ``p`` bytes per gathered parameter, ``r`` per reduced gradient and ``S``
ranks per shard group:

* a gather (ZeRO-2/3, in place on gloo): the gathered buffer is allocated again (its storage
  was released when the unit was last freed), zeroed, and this rank's rows are copied in; the
  bitwise-OR all-reduce then completes it in place. Per gathered parameter: ``p`` fresh, ``p``
  zeroed, ``p / S`` copied. Forward gathers every unit; backward again every block freed after
  forward (the planner's ``(L - 1)`` blocks, as in the communication volume);
* a reduce-scatter (ZeRO-2/3): the unit's gradients are packed into the scratch buffer
  (``r`` copied), all-reduced in place, and this rank's rows copied into a new output that
  becomes the ``.grad`` (``r / S`` copied, ``r / S`` fresh); the scratch buffer, the size of the
  largest unit, is dropped at the end of every backward and taken again (``P_u r`` fresh);
* ZeRO-1: the gradients are packed into a new buffer whose rows become the ``.grad`` (``r``
  copied, ``r`` fresh), all-reduced in place; the next forward zeroes the other ranks' rows of
  the fp32 parameters (``4 (S-1)/S`` zeroed) before the all-gather -- every micro-batch's
  forward, since each reduction marks the parameters for gathering again;
* ZeRO-0: the gradients are packed into the scratch buffer and copied back after the all-reduce
  (``2 r`` copied, ``P_u r`` fresh per backward); when ``r`` is not the parameters' dtype, the
  ZeRO-1 path instead;
* without mixed precision (``p = 4``) ZeRO-0/1 compute on the fp32 parameters themselves;
  otherwise each forward casts them (``p`` copied);
* accumulation: every micro-batch after the first adds its reduced rows into the ``.grad``
  (an addition, not counted: autograd's own accumulation is of the same kind and not counted
  either).

``tests/diagnostics/test_plan.py::test_host_traffic_counts_the_engines_copies`` runs the engine
and checks the copied and zeroed bytes exactly against these counts, for every strategy, with and
without accumulation. The fresh bytes are an upper bound: the allocator sometimes serves a new
buffer from memory freed earlier in the step (docs/planning.md has the page faults measured).

Autograd's own allocations (activations, the full gradients of each unit before they are
packed) are the model's and the same for every strategy; the calibrated matmul rate includes
the allocation of its outputs. What is charged here is the engine's work only.

Note: why CPU only. On a GPU these copies run in HBM at terabytes per second, on their own
streams, and the caching allocator returns warm blocks, so the planner leaves them out there
(published-run predictions are unchanged). On CPU they take turns with the compute on the same
cores, and a buffer allocated anew is a fresh ``mmap`` (large blocks) whose every page faults on
first touch -- on the benchmark machine several times slower than writing warm memory.
``shardline plan --calibrate`` measures the three rates.
"""

from __future__ import annotations

import dataclasses

from shardline.diagnostics.plan.architecture import Architecture
from shardline.engine import StrategyPolicy

__all__ = ["HostTraffic", "backward_regather_params", "host_traffic"]

_MASTER_BYTES = 4  # the engine keeps fp32 shards (the optimizer's parameters)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTraffic:
    """Bytes per step (per rank) of the engine's own memory work.

    Attributes:
        copied: Bytes copied (each read once and written once).
        zeroed: Bytes zeroed.
        fresh: Bytes of buffers allocated anew whose pages are touched for the first time.
    """

    copied: float
    zeroed: float
    fresh: float

    def seconds(self, *, copy_gbps: float, fill_gbps: float, first_touch_gbps: float) -> float:
        """Time at the measured rates (Gb/s): copy bandwidth, fill bandwidth, extra cost of a first touch."""
        return (self.copied / copy_gbps + self.zeroed / fill_gbps + self.fresh / first_touch_gbps) * 8 / 1e9


def backward_regather_params(
    arch: Architecture, *, policy: StrategyPolicy, shard: int, reshard_after_forward: bool | int | None
) -> tuple[int, int]:
    """Parameters gathered again in backward, and over how many ranks (0 and 1 when none are)."""
    if not policy.shard_params or shard <= 1 or arch.n_layers <= 1:
        return 0, 1
    frees = policy.reshard_after_forward if reshard_after_forward is None else bool(reshard_after_forward)
    if not frees:
        return 0, 1
    again = shard
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        again = reshard_after_forward
    if again <= 1:
        return 0, 1
    return (arch.n_layers - 1) * arch.block_params, again


def host_traffic(
    arch: Architecture,
    *,
    policy: StrategyPolicy,
    world: int,
    shard: int,
    reshard_after_forward: bool | int | None,
    param_bytes: int,
    reduce_bytes: int,
    accum: int,
) -> HostTraffic:
    """The engine's copies, fills and fresh allocations per step (see the module docstring)."""
    if world <= 1:
        return HostTraffic(copied=0.0, zeroed=0.0, fresh=0.0)
    psi = float(arch.num_params)
    unit = float(max(arch.block_params, arch.root_params))
    p, r = param_bytes, reduce_bytes
    copied = zeroed = fresh = 0.0
    if policy.shard_params and shard > 1:
        regathered, _ = backward_regather_params(
            arch, policy=policy, shard=shard, reshard_after_forward=reshard_after_forward
        )
        gathered = psi + regathered
        fresh += accum * (gathered * p + psi * r / shard + unit * r)
        zeroed += accum * gathered * p
        copied += accum * (gathered * p / shard + psi * r + psi * r / shard)
    else:
        if p != _MASTER_BYTES:  # each forward casts the fp32 parameters to the compute dtype
            copied += accum * psi * p
        if policy.shard_optimizer or r != p:  # ZeRO-1, or a reduction in another dtype: a new packed buffer
            copied += accum * psi * r
            fresh += accum * psi * r
        else:  # ZeRO-0: pack into the scratch buffer, copy the reduced values back
            copied += accum * 2 * psi * r
            fresh += accum * unit * r
        if policy.shard_optimizer:  # the in-place all-gather of the rows, before every micro-batch's forward
            zeroed += accum * psi * _MASTER_BYTES * (world - 1) / world
    return HostTraffic(copied=copied, zeroed=zeroed, fresh=fresh)
