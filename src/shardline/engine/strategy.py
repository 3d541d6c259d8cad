"""Sharding strategies: names users type, and the few knobs each one turns.

A strategy is not special-cased anywhere in the engine. It resolves to a
:class:`StrategyPolicy` -- whether parameters are partitioned, whether the optimizer sees
only this rank's rows, whether the mesh has a replica dimension, and when gathered
parameters are freed -- and the unit code only reads those knobs:

=====================  ============  ===============  ======  =====================
strategy               shard_params  shard_optimizer  hybrid  reshard_after_forward
=====================  ============  ===============  ======  =====================
NO_SHARD (ZeRO-0)      no            no               no      --
SHARD_OPT (ZeRO-1)     no            yes              no      --
SHARD_GRAD_OP (ZeRO-2) yes           yes              no      no
FULL_SHARD (ZeRO-3)    yes           yes              no      yes
HYBRID_SHARD_ZERO2     yes           yes              yes     no
HYBRID_SHARD           yes           yes              yes     yes
=====================  ============  ===============  ======  =====================
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
        shard_params: Parameters are split across the shard group: each rank keeps only its
            rows between uses and gathers full parameters for forward and backward (ZeRO-2/3).
            When False every rank keeps full parameters all the time.
        shard_optimizer: The parameters the optimizer sees between steps are this rank's rows,
            so optimizer state (and the reduced gradients it reads) are split across ranks.
            With ``shard_params=False`` this is ZeRO-1: gradients are all-reduced, each rank
            steps its own rows of the full parameters it keeps, and the updated rows are
            all-gathered into every rank's full parameters before the next forward.
        hybrid: The mesh has two dimensions: parameters are sharded inside each shard group and
            replicated across groups; gradients are reduce-scattered inside the shard group and
            all-reduced across replicas.
        reshard_after_forward: Free gathered parameters after forward (they are gathered again
            for backward). This is the default when ``fully_shard`` gets ``None``; the root
            unit overrides it to False because backward needs its parameters first.
        reshard_after_backward: Free gathered parameters once the unit's gradients are reduced.
    """

    shard_params: bool
    shard_optimizer: bool
    hybrid: bool
    reshard_after_forward: bool
    reshard_after_backward: bool

    def __post_init__(self) -> None:
        if self.shard_params and not self.shard_optimizer:
            raise ConfigurationError("a strategy that shards parameters also shards optimizer state")

    @property
    def replicated_params(self) -> bool:
        """Every rank keeps full parameters (ZeRO-0 and ZeRO-1)."""
        return not self.shard_params


class ShardingStrategy(str, enum.Enum):
    """How a unit shards its parameters, gradients and optimizer state.

    Accepts its value, its name (any case, ``-`` for ``_``) or an alias wherever a strategy is
    expected -- the library, ``shardline train trainer.strategy=``, ``shardline plan --strategy``,
    the Lightning strategy and ``ShardlineTrainer`` all take the same vocabulary:
    ``"full_shard"``/``"fsdp"``/``"zero3"``, ``"shard_grad_op"``/``"zero2"``,
    ``"shard_opt"``/``"zero1"``, ``"no_shard"``/``"ddp"``/``"zero0"``,
    ``"hybrid_shard"``/``"hsdp"``, ``"hybrid_shard_zero2"``/``"hsdp_zero2"``.
    """

    NO_SHARD = "no_shard"
    """ZeRO-0: full replicas, gradients all-reduced (like DDP)."""
    SHARD_OPT = "shard_opt"
    """ZeRO-1: full replicas and gradients all-reduced, optimizer state sharded; updated rows all-gathered."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: parameters gathered from forward through backward, gradients and optimizer state sharded."""
    FULL_SHARD = "full_shard"
    """ZeRO-3: parameters gathered just in time for forward and again for backward."""
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"
    """SHARD_GRAD_OP inside each shard group of a 2-D mesh, replicated across groups."""
    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD inside each shard group of a 2-D mesh, replicated across groups."""

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

    @classmethod
    def vocabulary(cls) -> dict[str, ShardingStrategy]:
        """Every name :meth:`parse` accepts (values and aliases, lower case) and the strategy it names."""
        return dict(_BY_NAME)

    @property
    def policy(self) -> StrategyPolicy:
        """The knobs this strategy turns (see :class:`StrategyPolicy`)."""
        return _POLICIES[self]

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this strategy corresponds to (0 to 3; hybrid ones: the stage inside a shard group)."""
        return _ZERO_STAGE[self]


_POLICIES = {
    ShardingStrategy.NO_SHARD: StrategyPolicy(
        shard_params=False,
        shard_optimizer=False,
        hybrid=False,
        reshard_after_forward=False,
        reshard_after_backward=True,
    ),
    ShardingStrategy.SHARD_OPT: StrategyPolicy(
        shard_params=False, shard_optimizer=True, hybrid=False, reshard_after_forward=False, reshard_after_backward=True
    ),
    ShardingStrategy.SHARD_GRAD_OP: StrategyPolicy(
        shard_params=True, shard_optimizer=True, hybrid=False, reshard_after_forward=False, reshard_after_backward=True
    ),
    ShardingStrategy.FULL_SHARD: StrategyPolicy(
        shard_params=True, shard_optimizer=True, hybrid=False, reshard_after_forward=True, reshard_after_backward=True
    ),
    ShardingStrategy.HYBRID_SHARD_ZERO2: StrategyPolicy(
        shard_params=True, shard_optimizer=True, hybrid=True, reshard_after_forward=False, reshard_after_backward=True
    ),
    ShardingStrategy.HYBRID_SHARD: StrategyPolicy(
        shard_params=True, shard_optimizer=True, hybrid=True, reshard_after_forward=True, reshard_after_backward=True
    ),
}

_ZERO_STAGE = {
    ShardingStrategy.NO_SHARD: 0,
    ShardingStrategy.SHARD_OPT: 1,
    ShardingStrategy.SHARD_GRAD_OP: 2,
    ShardingStrategy.FULL_SHARD: 3,
    ShardingStrategy.HYBRID_SHARD_ZERO2: 2,
    ShardingStrategy.HYBRID_SHARD: 3,
}

_ALIASES = {
    "fsdp": ShardingStrategy.FULL_SHARD,
    "ddp": ShardingStrategy.NO_SHARD,
    "zero0": ShardingStrategy.NO_SHARD,
    "zero1": ShardingStrategy.SHARD_OPT,
    "zero2": ShardingStrategy.SHARD_GRAD_OP,
    "zero3": ShardingStrategy.FULL_SHARD,
    "hsdp": ShardingStrategy.HYBRID_SHARD,
    "hsdp_zero2": ShardingStrategy.HYBRID_SHARD_ZERO2,
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
