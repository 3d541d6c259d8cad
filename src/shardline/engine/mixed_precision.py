"""Mixed-precision policy for a unit: which dtypes parameters, gradients and buffers use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline.errors import ConfigurationError

__all__ = ["MixedPrecision"]


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes a sharded unit computes and communicates in.

    The sharded parameters the optimizer sees always keep their original dtype (fp32 master
    weights), and so do their gradients.

    Attributes:
        param_dtype: Dtype of the gathered parameters used by forward and backward. Shards are
            cast before the all-gather, so the all-gather moves half the bytes for bf16.
            ``None`` keeps the parameters' own dtype.
        reduce_dtype: Dtype gradients are reduced in. ``None`` means ``param_dtype`` (or the
            parameters' dtype when that is ``None`` too). Reduced gradients are cast back to
            the master dtype before they reach the optimizer.
        buffer_dtype: Floating-point buffers are stored in this dtype while training; full
            state dicts give them back in their original dtype. ``None`` leaves buffers alone.
        output_dtype: If set, floating-point forward outputs of the unit are cast to it.
        cast_forward_inputs: Cast floating-point forward inputs of the unit to ``param_dtype``
            so modules see matching dtypes.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ConfigurationError(
                    f"MixedPrecision.{name} must be a floating-point torch.dtype such as torch.bfloat16 "
                    f"or None, got {value!r}"
                )

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype parameters are gathered and used in, for master weights of dtype ``master``."""
        return self.param_dtype or master

    def gradient_reduce_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients travel in, for master weights of dtype ``master``."""
        return self.reduce_dtype or self.param_dtype or master
