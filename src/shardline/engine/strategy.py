"""Sharding strategies: names users type, and the few knobs each one turns.

A strategy is not special-cased anywhere in the engine. It resolves to a
:class:`StrategyPolicy` -- whether parameters are partitioned, when gathered parameters are
freed, and how gradients are reduced -- and the unit code only reads those knobs. ZeRO-1
(shard optimizer state only) and hybrid sharding (shard inside a group, replicate across
groups) are new combinations of the same knobs plus a second mesh dimension.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass

from shardline.errors import ConfigurationError

__all__ = ["ShardingStrategy", "StrategyPolicy"]


@dataclass(frozen=True)
class StrategyPolicy:
    """What a strategy means for one unit.

    Attributes:
        shard_params: Parameters (and so gradients and optimizer state) are split across the
            data-parallel ranks. When False every rank keeps full parameters and gradients are
            all-reduced (DDP / ZeRO-0).
        reshard_after_forward: Free gathered parameters after forward (they are gathered again
            for backward). This is the default when ``fully_shard`` gets ``None``; the root
            unit overrides it to False because backward needs its parameters first.
        reshard_after_backward: Free gathered parameters once the unit's gradients are reduced.
    """

    shard_params: bool
    reshard_after_forward: bool
    reshard_after_backward: bool


class ShardingStrategy(str, enum.Enum):
    """How a unit shards its parameters, gradients and optimizer state.

    Accepts its value, its name (any case) or an alias wherever a strategy is expected:
    ``"full_shard"``/``"zero3"``, ``"shard_grad_op"``/``"zero2"``, ``"no_shard"``/``"ddp"``/``"zero0"``.
    """

    NO_SHARD = "no_shard"
    """ZeRO-0: full replicas, gradients all-reduced (like DDP)."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: parameters gathered from forward through backward, gradients and optimizer state sharded."""
    FULL_SHARD = "full_shard"
    """ZeRO-3: parameters gathered just in time for forward and again for backward."""

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Return the strategy named by ``value`` (enum member, name, value or alias)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower().replace("-", "_")
            found = _BY_NAME.get(key)
            if found is not None:
                return found
            names = sorted(_BY_NAME)
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(
                f"unknown sharding strategy {value!r}.{hint} Expected one of: {_describe_choices()}."
            )
        raise ConfigurationError(
            f"sharding strategy must be a ShardingStrategy or a string, got {type(value).__name__}: {value!r}. "
            f"Expected one of: {_describe_choices()}."
        )

    @property
    def policy(self) -> StrategyPolicy:
        """The knobs this strategy turns (see :class:`StrategyPolicy`)."""
        return _POLICIES[self]

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this strategy corresponds to (0, 2 or 3)."""
        return _ZERO_STAGE[self]


_POLICIES = {
    ShardingStrategy.NO_SHARD: StrategyPolicy(
        shard_params=False, reshard_after_forward=False, reshard_after_backward=True
    ),
    ShardingStrategy.SHARD_GRAD_OP: StrategyPolicy(
        shard_params=True, reshard_after_forward=False, reshard_after_backward=True
    ),
    ShardingStrategy.FULL_SHARD: StrategyPolicy(
        shard_params=True, reshard_after_forward=True, reshard_after_backward=True
    ),
}

_ZERO_STAGE = {
    ShardingStrategy.NO_SHARD: 0,
    ShardingStrategy.SHARD_GRAD_OP: 2,
    ShardingStrategy.FULL_SHARD: 3,
}

_ALIASES = {
    "ddp": ShardingStrategy.NO_SHARD,
    "zero0": ShardingStrategy.NO_SHARD,
    "zero2": ShardingStrategy.SHARD_GRAD_OP,
    "zero3": ShardingStrategy.FULL_SHARD,
}

_BY_NAME: dict[str, ShardingStrategy] = {
    **{member.value: member for member in ShardingStrategy},
    **_ALIASES,
}


def _describe_choices() -> str:
    parts = []
    for member in ShardingStrategy:
        aliases = [alias for alias, target in _ALIASES.items() if target is member]
        parts.append(member.value + (f" ({', '.join(aliases)})" if aliases else ""))
    return ", ".join(parts)
