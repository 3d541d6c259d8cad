"""Loss scaling for fp16 compute over sharded units, with the overflow verdict agreed by every rank.

fp16 has a narrow exponent: small gradients underflow to zero unless the loss is multiplied by a
large scale before backward, and a scale too large overflows them to inf. The standard dynamic
scaler (``torch.amp.GradScaler``) starts high, skips a step whose gradients hold inf/NaN and halves
the scale, and doubles it again after ``growth_interval`` clean steps.

Note: with sharded gradients each rank sees only its shard, so an overflow may be visible on one
rank alone. Each rank checks its own gradient pieces and one all-reduce (MAX of a single 0/1
flag) over the data-parallel group -- the whole world for hybrid sharding, whose group spans
every shard group and replica -- makes the verdict common: the step is skipped, and the scale
backs off, on every rank or on none. torch's own ``ShardedGradScaler`` does the same but issues
its all-reduce behind shardline's back (uncounted, on its own group); this scaler sends it
through the units' :class:`~shardline.engine.comm.Comm`, recorded with phase ``"grad_scaler"``.

The scale, the growth counter and the verdict are device tensors, updated without a host read;
only :meth:`ShardedGradScaler.step` reads the verdict (to call or skip ``optimizer.step``).
Optimizers that take a ``found_inf`` tensor (the fused ones) can skip on the device instead:
see :attr:`ShardedGradScaler.found_inf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardline.engine.grad import common_dp_root
from shardline.engine.registry import subtree_units
from shardline.errors import ConfigurationError

__all__ = ["LossScaling", "ShardedGradScaler"]

PHASE = "grad_scaler"


@dataclass(frozen=True)
class LossScaling:
    """How the loss scale starts and moves (the defaults are ``torch.amp.GradScaler``'s).

    Attributes:
        init_scale: The first scale the loss is multiplied by.
        growth_factor: Multiplies the scale after ``growth_interval`` steps in a row without inf/NaN.
        backoff_factor: Multiplies the scale after a step with inf/NaN gradients (that step is skipped).
        growth_interval: Clean steps in a row before the scale grows.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ConfigurationError(f"LossScaling.init_scale must be a positive finite number, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ConfigurationError(f"LossScaling.growth_factor must be above 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ConfigurationError(f"LossScaling.backoff_factor must be between 0 and 1, got {self.backoff_factor}")
        if (
            isinstance(self.growth_interval, bool)
            or not isinstance(self.growth_interval, int)
            or self.growth_interval < 1
        ):
            raise ConfigurationError(
                f"LossScaling.growth_interval must be a positive integer, got {self.growth_interval!r}"
            )


class ShardedGradScaler:
    """Dynamic loss scaler for a sharded model; every rank skips the same steps.

    Per step::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)        # optional: before clipping, so the norm is of true gradients
        model.clip_grad_norm_(max_norm)
        scaler.step(optimizer)            # skipped on every rank if any rank found inf/NaN
        scaler.update()

    Args:
        module: The sharded model (its units name the data-parallel group and the collectives'
            account). A model with no sharded units agrees over the default group when a process
            group is initialized, and on its own otherwise.
        policy: The scale's start and how it moves.
    """

    def __init__(self, module: nn.Module, *, policy: LossScaling | None = None) -> None:
        self.policy = policy or LossScaling()
        units = subtree_units(module)
        self._root = common_dp_root(units, "ShardedGradScaler") if units else None
        if self._root is not None:
            self._device = self._root.device if self._root.device.type != "meta" else torch.device("cpu")
        else:
            self._device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._scale = torch.full((), self.policy.init_scale, dtype=torch.float32, device=self._device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=self._device)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=self._device)
        self._unscaled = False

    # ------------------------------------------------------------------ per step
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (backpropagate this instead of ``loss``)."""
        return loss * self._scale.to(loss.device, loss.dtype if loss.is_floating_point() else torch.float32)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Divide ``optimizer``'s gradients by the scale and agree whether any rank saw inf/NaN.

        Once per step (later calls before :meth:`update` return the same verdict). Issues one
        all-reduce over the data-parallel group. Returns the verdict: a float32 device tensor,
        1 if some rank found inf/NaN, else 0.
        """
        if self._unscaled:
            return self._found_inf
        inv = self._scale.double().reciprocal().float()
        local = torch.zeros((), dtype=torch.float32, device=self._device)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.grad.numel():
                    continue
                if p.grad.is_sparse:
                    raise ConfigurationError("ShardedGradScaler does not unscale sparse gradients")
                bad = torch.logical_not(torch.isfinite(p.grad).all()).to(torch.float32)
                torch.maximum(local, bad.to(local.device), out=local)
                p.grad.mul_(inv.to(p.grad.device, p.grad.dtype))
        self._agree(local)
        self._found_inf.copy_(local)
        self._unscaled = True
        return self._found_inf

    def _agree(self, found: torch.Tensor) -> None:
        """Make ``found`` the maximum over the data-parallel group (one all-reduce)."""
        root = self._root
        if root is not None:
            root.ctx.comm.all_reduce(
                found, root.mesh.dp_group, op=dist.ReduceOp.MAX, unit=root.display_name, phase=PHASE
            )
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> bool:
        """Unscale (if not done yet), then ``optimizer.step(**kwargs)`` unless a rank found inf/NaN.

        Reads the agreed verdict on the host. Returns whether the optimizer stepped (the same on
        every rank).
        """
        found = self.unscale_(optimizer)
        if found.item():
            return False
        optimizer.step(**kwargs)
        return True

    def update(self) -> None:
        """Move the scale after a step: back off on inf/NaN, grow after enough clean steps.

        On the device, without a host read; every rank computes the same new scale from the
        agreed verdict.
        """
        found = self._found_inf > 0
        tracker = torch.where(found, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grow = tracker >= self.policy.growth_interval
        one = torch.ones_like(self._scale)
        factor = torch.where(
            found,
            one * self.policy.backoff_factor,
            torch.where(grow, one * self.policy.growth_factor, one),
        )
        self._scale.mul_(factor)
        self._growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
        self._found_inf.zero_()
        self._unscaled = False

    # ------------------------------------------------------------------ state
    @property
    def found_inf(self) -> torch.Tensor:
        """The agreed verdict of the step being taken (after :meth:`unscale_`): 1.0 skips, 0.0 steps."""
        return self._found_inf

    def get_scale(self) -> float:
        """The current scale (a host read)."""
        return float(self._scale.item())

    def state_dict(self) -> dict[str, float | int]:
        """The scale and growth counter, as plain numbers (the policy comes from the configuration)."""
        return {"scale": self.get_scale(), "growth_tracker": int(self._growth_tracker.item())}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ConfigurationError(
                f"ShardedGradScaler state is missing {sorted(missing)}; got keys {sorted(state)}. Pass what "
                "ShardedGradScaler.state_dict() returned."
            )
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))
