"""torchao's 4-bit NormalFloat weights (``NF4Tensor``): the one module that knows their insides.

The engine shards NF4 weights along their quantization blocks (see
:mod:`shardline.engine.quantized`); this module is everything it needs to know about the tensor
type: recognizing one, its layout (block sizes, how many bytes each piece takes), taking it
apart into its component tensors and putting it back together, and a checksum of those
components. torchao is optional (the ``qlora`` extra): nothing here imports it until a model
holds an NF4 tensor, which means torchao was imported already.

Note: what an NF4 tensor of ``n`` elements holds (torchao's QLoRA format). ``quantized_data``:
``n/2`` bytes, two 4-bit codes each; ``quantized_scalers``: one int8 per block of
``block_size`` elements (the block's absmax, double quantized); ``quantization_factor``: one
float per group of ``scaler_block_size`` blocks (it dequantizes that group's int8 scalers);
``scaler_mean``: one float for the whole tensor; ``nf4``: the 16-entry code book. A range of
whole *scaler groups* (``block_size * scaler_block_size`` elements) is therefore a valid NF4
tensor by itself, with the same ``scaler_mean`` and code book: that is the unit the engine
splits and gathers.

Note: torchao versions. ``NF4Tensor`` and ``to_nf4`` moved from ``torchao.dtypes.nf4tensor``
(up to 0.14) to ``torchao.quantization`` (0.15 on); both are tried. The attributes and the
constructor's keywords read here are checked once, on first use, and a release that renamed
one is refused with the names missing (:func:`nf4_api`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardline.engine.quant_format import byte_checksum
from shardline.errors import ConfigurationError

__all__ = ["COMPONENTS", "NF4Format", "NF4Layout", "build_nf4", "checksum", "is_nf4", "nf4_api", "to_nf4"]

# The component tensors, in the order the engine packs them.
COMPONENTS = ("quantization_factor", "quantized_scalers", "quantized_data")
_REPLICATED = ("scaler_mean", "nf4")  # the same for every piece of one tensor
_ATTRIBUTES = (*COMPONENTS, *_REPLICATED, "block_size", "scaler_block_size", "n_blocks")
_CONSTRUCTOR = ("tensor_meta", "block_size", "n_blocks", "scaler_block_size", *COMPONENTS, *_REPLICATED)


@dataclass(frozen=True)
class _API:
    tensor_class: Any  # torchao's NF4Tensor (torchao ships no type information)
    to_nf4: Callable[..., torch.Tensor]
    tensor_args: Callable[..., Any]  # torchao's SubclassTensorArgs
    version: str


@functools.cache
def nf4_api() -> _API:
    """torchao's NF4 classes, checked against what the engine reads (raises ``ConfigurationError`` if absent)."""
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a CPU-only torch makes torchao warn about its CUDA kernels it cannot load
    try:
        import torchao

        try:
            from torchao.quantization import NF4Tensor
            from torchao.quantization import to_nf4 as _to_nf4
        except ImportError:
            from torchao.dtypes.nf4tensor import NF4Tensor
            from torchao.dtypes.nf4tensor import to_nf4 as _to_nf4
    except ImportError as exc:
        raise ConfigurationError(
            f"4-bit NF4 weights need torchao, which cannot be imported ({exc}). Install it: pip install "
            "'shardline[qlora]'."
        ) from exc
    finally:
        logger.setLevel(level)
    version = str(getattr(torchao, "__version__", "unknown"))
    module = sys.modules[NF4Tensor.__module__]
    tensor_args = getattr(module, "SubclassTensorArgs", None)
    parameters = set(inspect.signature(NF4Tensor.__init__).parameters)
    missing = [name for name in _CONSTRUCTOR if name not in parameters]
    if tensor_args is None:
        missing.append(f"{module.__name__}.SubclassTensorArgs")
    probe = _to_nf4(torch.arange(4.0), 2, 2) if not missing else None
    missing += [name for name in _ATTRIBUTES if probe is not None and not hasattr(probe, name)]
    if missing:
        raise ConfigurationError(
            f"torchao {version} changed its NF4Tensor: shardline reads {', '.join(missing)}, which it no longer has. "
            "Install a torchao release shardline supports: pip install 'shardline[qlora]'."
        )
    assert tensor_args is not None  # else refused above
    return _API(NF4Tensor, _to_nf4, tensor_args, version)


def to_nf4(tensor: torch.Tensor, *, block_size: int = 64, scaler_block_size: int = 256) -> torch.Tensor:
    """``tensor`` quantized to a torchao ``NF4Tensor`` (its element count must divide by both block sizes' product)."""
    numel = tensor.numel()
    group = block_size * scaler_block_size
    if numel % group:
        raise ConfigurationError(
            f"cannot quantize a tensor of shape {tuple(tensor.shape)} ({numel} elements) to NF4 with block_size="
            f"{block_size} and scaler_block_size={scaler_block_size}: its element count must be a multiple of "
            f"{group} (their product). Choose smaller block sizes or leave this weight unquantized."
        )
    return nf4_api().to_nf4(tensor.detach().contiguous(), block_size, scaler_block_size)


def is_nf4(tensor: object) -> bool:
    """Whether ``tensor`` is a torchao ``NF4Tensor`` (False without importing torchao when it is not loaded)."""
    if "torchao" not in sys.modules or not isinstance(tensor, torch.Tensor):
        return False
    return isinstance(tensor, nf4_api().tensor_class)


@dataclass(frozen=True)
class NF4Layout:
    """The shape and block structure of one NF4 weight, and how its bytes divide into scaler groups."""

    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype it dequantizes to
    block_size: int
    scaler_block_size: int
    factor_dtype: torch.dtype  # dtype of quantization_factor

    @classmethod
    def of(cls, tensor: Any) -> NF4Layout:
        """The layout of the NF4 tensor ``tensor``."""
        return cls(
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            block_size=int(tensor.block_size),
            scaler_block_size=int(tensor.scaler_block_size),
            factor_dtype=tensor.quantization_factor.dtype,
        )

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def group_numel(self) -> int:
        """Elements of one scaler group: the smallest piece that is an NF4 tensor by itself."""
        return self.block_size * self.scaler_block_size

    @property
    def groups(self) -> int:
        return self.numel // self.group_numel

    def component_numels(self, groups: int) -> tuple[int, ...]:
        """Elements of each of :data:`COMPONENTS` for ``groups`` scaler groups."""
        return (groups, groups * self.scaler_block_size, groups * self.group_numel // 2)

    def component_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.factor_dtype, torch.int8, torch.uint8)

    def problems(self, tensor: object, *, groups: int) -> list[str]:
        """How ``tensor`` fails to be an NF4 piece of ``groups`` scaler groups of this layout (empty if it is one)."""
        if not is_nf4(tensor):
            return [f"is a {type(tensor).__name__}, no longer an NF4Tensor"]
        found: list[str] = []
        for attr in ("block_size", "scaler_block_size"):
            if getattr(tensor, attr) != getattr(self, attr):
                found.append(f"{attr} is {getattr(tensor, attr)}, was {getattr(self, attr)}")
        for name, numel, dtype in zip(COMPONENTS, self.component_numels(groups), self.component_dtypes(), strict=True):
            part = getattr(tensor, name, None)
            if not isinstance(part, torch.Tensor):
                found.append(f"its {name} is missing")
            elif part.numel() != numel or part.dtype != dtype:
                found.append(f"its {name} holds {part.numel()} x {part.dtype}, expected {numel} x {dtype}")
        for name in _REPLICATED:
            part = getattr(tensor, name, None)
            if not isinstance(part, torch.Tensor) or not bool(torch.isfinite(part).all()):
                found.append(f"its {name} is missing or not finite")
        return found


def build_nf4(
    layout: NF4Layout,
    parts: tuple[torch.Tensor, ...],
    *,
    scaler_mean: torch.Tensor,
    code_book: torch.Tensor,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """An NF4 tensor of ``layout`` (or a 1-D piece of it, ``shape``) from its :data:`COMPONENTS` ``parts``."""
    api = nf4_api()
    factor, scalers, data = parts
    shape = layout.shape if shape is None else shape
    size = torch.Size(shape)
    strides = tuple(int(s) for s in torch.empty(size, device="meta").stride())
    meta = api.tensor_args(size, strides, 0, layout.dtype, data.device, False)
    built: torch.Tensor = api.tensor_class(
        tensor_meta=meta,
        block_size=layout.block_size,
        n_blocks=scalers.numel(),
        scaler_block_size=layout.scaler_block_size,
        quantized_scalers=scalers,
        quantization_factor=factor,
        scaler_mean=scaler_mean,
        quantized_data=data,
        nf4=code_book,
    )
    return built


def checksum(tensor: Any) -> tuple[int, ...]:
    """A position-sensitive checksum of each component of the NF4 tensor ``tensor`` (see ``byte_checksum``)."""
    return byte_checksum([getattr(tensor, name) for name in (*COMPONENTS, *_REPLICATED)])


@dataclass(frozen=True, eq=False)
class NF4Format:
    """An NF4 weight's :class:`~shardline.engine.quant_format.QuantFormat`: its layout and shared state.

    A group is one scaler group (see the module note).
    """

    layout: NF4Layout
    scaler_mean: torch.Tensor
    code_book: torch.Tensor
    kind: str = "NF4Tensor"
    components: tuple[str, ...] = COMPONENTS
    checksum_names: tuple[str, ...] = (*COMPONENTS, *_REPLICATED)

    @classmethod
    def of(cls, tensor: Any) -> NF4Format:
        """The format of the NF4 tensor ``tensor`` (its shared state copied)."""
        return cls(NF4Layout.of(tensor), tensor.scaler_mean.detach().clone(), tensor.nf4.detach().clone())

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def group_numel(self) -> int:
        return self.layout.group_numel

    @property
    def groups(self) -> int:
        return self.layout.groups

    def describe(self) -> str:
        return (
            f"shape {self.layout.shape}, block_size {self.layout.block_size}, scaler_block_size "
            f"{self.layout.scaler_block_size}"
        )

    def requantize_hint(self) -> str:
        return "Quantize it again with torchao's to_nf4 before sharding."

    def release_owner(self, module: torch.nn.Module) -> None:
        pass  # a module keeps nothing of an NF4 weight but the weight

    def component_numels(self, groups: int) -> tuple[int, ...]:
        return self.layout.component_numels(groups)

    def component_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.layout.component_dtypes()

    def parts(self, tensor: Any, start: int, count: int) -> tuple[torch.Tensor, ...]:
        out = []
        for name, per_group in zip(COMPONENTS, self.layout.component_numels(1), strict=True):
            flat = getattr(tensor, name).reshape(-1)
            out.append(flat[start * per_group : (start + count) * per_group])
        return tuple(out)

    def build(self, parts: tuple[torch.Tensor, ...], *, shape: tuple[int, ...] | None = None) -> torch.nn.Parameter:
        device = parts[0].device  # the shared state follows the parts (host memory under CPU offload)
        mean, book = self.scaler_mean.to(device), self.code_book.to(device)
        built = build_nf4(self.layout, parts, scaler_mean=mean, code_book=book, shape=shape)
        return torch.nn.Parameter(built, requires_grad=False)

    def problems(self, tensor: object, *, groups: int) -> list[str]:
        if self.layout.numel % self.layout.group_numel:
            return [f"{self.layout.numel} elements are not whole scaler groups of {self.layout.group_numel}"]
        return self.layout.problems(tensor, groups=groups)

    def checksum(self, tensor: Any) -> tuple[int, ...]:
        return checksum(tensor)
