"""bitsandbytes' 4-bit weights (``Params4bit``): the one module that imports bitsandbytes.

The engine shards 4-bit weights along their quantization blocks (see
:mod:`shardline.engine.quantized`); this module is everything it needs to know about
bitsandbytes' format: recognizing a ``Params4bit``, its layout, taking it apart into component
tensors and rebuilding it with a fresh ``QuantState``. bitsandbytes is optional (the ``qlora``
extra): nothing here imports it until a model holds a ``Params4bit``, which means it was
imported already.

Note: what a ``Params4bit`` of ``n`` elements holds (nf4 or fp4 alike). ``data``: ``n/2``
bytes of packed 4-bit codes (viewed as ``quant_storage``, shape ``(-1, 1)``); its
``quant_state``: ``absmax``, one per block of ``blocksize`` elements; the 16-entry ``code``;
``shape`` and ``dtype`` of the weight it dequantizes to. Without double quantization
(``compress_statistics=False``) ``absmax`` is float32 and one block is a group. With it,
``absmax`` holds one uint8 code per block, dequantized by a nested state (``state2``: float32
``absmax`` per nested block of 256 blocks, its own 256-entry ``code``) plus ``offset``, one
float for the whole weight. A group is then one nested block (256 blocks): its codes, its 256
uint8 absmax codes and its one nested absmax decode alone with the shared ``code``, ``offset``
and nested ``code``, so every rank's piece is a valid ``Params4bit`` by itself.

Note: bitsandbytes versions. Tested with 0.50.2. The constructor keywords and ``QuantState``
fields read here are checked once, on first use; a release that renamed one is refused with
the names missing (:func:`bnb_api`). On import bitsandbytes logs that its optional ``kernels``
package is absent (CPU only; harmless): silenced here while it loads.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardline.engine.quant_format import byte_checksum
from shardline.errors import ConfigurationError

__all__ = ["Params4bitFormat", "bnb_api", "is_params4bit"]

_QUANT_STATE = ("absmax", "shape", "code", "blocksize", "quant_type", "dtype", "offset", "state2")
_PARAMS = (
    *("data", "requires_grad", "quant_state", "blocksize", "compress_statistics", "quant_type"),
    *("quant_storage", "bnb_quantized"),
)


@dataclass(frozen=True)
class _API:
    params_class: Any  # bitsandbytes' Params4bit (bitsandbytes ships no type information)
    quant_state: Any  # bitsandbytes.functional.QuantState
    version: str


@functools.cache
def bnb_api() -> _API:
    """bitsandbytes' 4-bit classes, checked against what the engine uses (raises ``ConfigurationError`` if absent)."""
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a CPU-only install logs that the optional `kernels` package is missing
    try:
        import bitsandbytes
        from bitsandbytes.functional import QuantState
        from bitsandbytes.nn.modules import Params4bit
    except ImportError as exc:
        raise ConfigurationError(
            f"bitsandbytes 4-bit weights need bitsandbytes, which cannot be imported ({exc}). Install it: pip "
            "install 'shardline[qlora]'."
        ) from exc
    finally:
        logger.setLevel(level)
    version = str(getattr(bitsandbytes, "__version__", "unknown"))
    missing = [n for n in _QUANT_STATE if n not in inspect.signature(QuantState.__init__).parameters]
    missing += [n for n in _PARAMS if n not in inspect.signature(Params4bit.__new__).parameters]
    if missing:
        raise ConfigurationError(
            f"bitsandbytes {version} changed Params4bit/QuantState: shardline uses {', '.join(missing)}, which they "
            "no longer take. Install a bitsandbytes release shardline supports: pip install 'shardline[qlora]'."
        )
    return _API(Params4bit, QuantState, version)


def is_params4bit(tensor: object) -> bool:
    """Whether ``tensor`` is a bitsandbytes ``Params4bit`` (False without importing it when it is not loaded)."""
    if "bitsandbytes" not in sys.modules or not isinstance(tensor, torch.Tensor):
        return False
    return isinstance(tensor, bnb_api().params_class)


@dataclass(frozen=True, eq=False)
class _Nested:
    """The double-quantization state every piece of one weight shares."""

    offset: torch.Tensor
    code: torch.Tensor
    blocksize: int  # blocks per nested block
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class Params4bitFormat:
    """A ``Params4bit`` weight's :class:`~shardline.engine.quant_format.QuantFormat` (see the module note)."""

    shape: tuple[int, ...]
    dtype: torch.dtype  # what it dequantizes to
    blocksize: int
    quant_type: str
    quant_storage: torch.dtype
    code: torch.Tensor
    absmax_dtype: torch.dtype
    nested: _Nested | None
    kind: str = "bitsandbytes Params4bit"

    @classmethod
    def of(cls, param: Any) -> Params4bitFormat:
        """The format of ``param`` (its shared state copied); ``ValueError`` if it has no quantization state."""
        state = getattr(param, "quant_state", None)
        if state is None:
            raise ValueError(
                "its quant_state is None: the Params4bit lost its quantization state (or was never quantized: "
                "bitsandbytes quantizes a Linear4bit's weight on its first .to(device)). Call .to(device) on the "
                "Linear4bit, or load the 4-bit model again, before fully_shard"
            )
        state2 = state.state2
        nested = None
        if state2 is not None:
            offset = torch.as_tensor(state.offset).detach().clone()
            nested = _Nested(offset, state2.code.detach().clone(), int(state2.blocksize), state2.dtype)
        return cls(
            shape=tuple(int(s) for s in state.shape),
            dtype=state.dtype,
            blocksize=int(state.blocksize),
            quant_type=str(state.quant_type),
            quant_storage=param.data.dtype,
            code=state.code.detach().clone(),
            absmax_dtype=state.absmax.dtype,
            nested=nested,
        )

    # ------------------------------------------------------------------ layout
    @property
    def components(self) -> tuple[str, ...]:
        return ("data", "absmax", "nested_absmax") if self.nested is not None else ("data", "absmax")

    @property
    def checksum_names(self) -> tuple[str, ...]:
        shared = ("offset", "nested_code", "code") if self.nested is not None else ("code",)
        return (*self.components, *shared)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def blocks_per_group(self) -> int:
        return self.nested.blocksize if self.nested is not None else 1

    @property
    def group_numel(self) -> int:
        return self.blocksize * self.blocks_per_group

    @property
    def groups(self) -> int:
        return self.numel // self.group_numel

    def describe(self) -> str:
        nested = f", double quantized in blocks of {self.blocks_per_group}" if self.nested is not None else ""
        return f"shape {self.shape}, {self.quant_type}, blocksize {self.blocksize}{nested}"

    def requantize_hint(self) -> str:
        return "Load or quantize it again with bitsandbytes (Linear4bit(...).to(device)) before sharding."

    def release_owner(self, module: nn.Module) -> None:
        # Note: a Linear4bit keeps its weight's whole QuantState as `module.quant_state` (to restore a weight that
        # lost it). Kept, every rank would hold the full absmax state (1/9 of the 4-bit bytes without double
        # quantization); the engine's weights always carry their state (checked before the first step).
        if getattr(module, "quant_state", None) is not None:
            setattr(module, "quant_state", None)  # noqa: B010  (an attribute of Linear4bit, not of nn.Module)

    def component_numels(self, groups: int) -> tuple[int, ...]:
        numels = (groups * self.group_numel // 2, groups * self.blocks_per_group)
        return (*numels, groups) if self.nested is not None else numels

    def component_dtypes(self) -> tuple[torch.dtype, ...]:
        dtypes = (torch.uint8, self.absmax_dtype)
        return (*dtypes, self.nested.dtype) if self.nested is not None else dtypes

    # ------------------------------------------------------------------ split / join
    def parts(self, tensor: Any, start: int, count: int) -> tuple[torch.Tensor, ...]:
        state = tensor.quant_state
        flats = [tensor.data.reshape(-1).view(torch.uint8), state.absmax.reshape(-1)]
        if self.nested is not None:
            flats.append(state.state2.absmax.reshape(-1))
        return tuple(
            flat[start * per : (start + count) * per] for flat, per in zip(flats, self.component_numels(1), strict=True)
        )

    def build(self, parts: tuple[torch.Tensor, ...], *, shape: tuple[int, ...] | None = None) -> nn.Parameter:
        api = bnb_api()
        data, absmax = parts[0], parts[1]
        device = data.device  # the shared state follows the parts (host memory under CPU offload)
        state2 = None
        if self.nested is not None:
            nested_code = self.nested.code.to(device)
            state2 = api.quant_state(
                absmax=parts[2], code=nested_code, blocksize=self.nested.blocksize, dtype=self.nested.dtype
            )
        state = api.quant_state(
            absmax=absmax,
            shape=torch.Size(self.shape if shape is None else shape),
            code=self.code.to(device),
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=self.nested.offset.to(device) if self.nested is not None else None,
            state2=state2,
        )
        built: nn.Parameter = api.params_class(
            data=data.view(self.quant_storage).reshape(-1, 1),
            requires_grad=False,
            quant_state=state,
            blocksize=self.blocksize,
            compress_statistics=self.nested is not None,
            quant_type=self.quant_type,
            quant_storage=self.quant_storage,
            bnb_quantized=True,
        )
        return built

    # ------------------------------------------------------------------ check
    def problems(self, tensor: Any, *, groups: int) -> list[str]:
        if not is_params4bit(tensor):
            return [f"is a {type(tensor).__name__}, no longer a Params4bit"]
        if self.numel % self.group_numel:
            return [f"{self.numel} elements are not whole groups of {self.group_numel} (blocksize x blocks per group)"]
        state: Any = getattr(tensor, "quant_state", None)
        if state is None:
            return ["its quant_state is None (the quantization state was lost)"]
        found: list[str] = []
        seen = {"blocksize": state.blocksize, "quant_type": state.quant_type, "dtype": state.dtype}
        for attr, value in seen.items():
            if value != getattr(self, attr):
                found.append(f"its quant_state.{attr} is {value}, was {getattr(self, attr)}")
        if int(torch.Size(state.shape).numel()) != groups * self.group_numel:
            found.append(f"its quant_state.shape {tuple(state.shape)} is not {groups * self.group_numel} elements")
        if (state.state2 is not None) != (self.nested is not None):
            found.append("its double quantization (quant_state.state2) " + ("vanished" if self.nested else "appeared"))
            return found
        pieces = [tensor.data.reshape(-1).view(torch.uint8), state.absmax]
        pieces += [state.state2.absmax] if state.state2 is not None else []
        numels = self.component_numels(groups)
        for name, part, numel, dtype in zip(self.components, pieces, numels, self.component_dtypes(), strict=True):
            if part.numel() != numel or part.dtype != dtype:
                found.append(f"its {name} holds {part.numel()} x {part.dtype}, expected {numel} x {dtype}")
        shared = [state.code] + ([torch.as_tensor(state.offset), state.state2.code] if state.state2 is not None else [])
        if not all(bool(torch.isfinite(t).all()) for t in shared):
            found.append("its code, offset or nested code is not finite")
        return found

    def checksum(self, tensor: Any) -> tuple[int, ...]:
        state = tensor.quant_state
        tensors = list(self.parts(tensor, 0, self.groups_in(tensor)))
        if self.nested is not None:
            tensors += [torch.as_tensor(state.offset), state.state2.code]
        return byte_checksum([*tensors, state.code])

    def groups_in(self, tensor: Any) -> int:
        """Groups the (whole or partial) weight ``tensor`` holds."""
        return int(torch.Size(tensor.quant_state.shape).numel()) // self.group_numel
