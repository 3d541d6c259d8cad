"""What the engine needs of a 4-bit weight format: split, join, check (one implementation per library).

:class:`~shardline.engine.quantized.QuantizedGroup` shards every 4-bit frozen weight the same
way -- whole self-contained *groups* of elements per rank, the group's component tensors packed
into one byte buffer, gathered with one all-gather -- and knows nothing of the formats. A
:class:`QuantFormat` is one weight's layout in one library's format, with the state every piece
shares (code books, offsets): :class:`~shardline.engine.nf4.NF4Format` for torchao's
``NF4Tensor``, :class:`~shardline.engine.bnb4.Params4bitFormat` for bitsandbytes' ``Params4bit``.

Note: a *group* is the smallest run of elements that dequantizes by itself: the components of
groups ``[start, start + count)`` of a weight, with the shared state, rebuild a valid 1-D weight
of that format (the shard a rank holds between steps), and the concatenated components of all
groups rebuild the original weight bit for bit.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["QuantFormat", "byte_checksum"]


class QuantFormat(Protocol):
    """One quantized weight's layout in its library's format (see the module note)."""

    @property
    def kind(self) -> str:
        """The format's name in messages, e.g. ``"NF4Tensor"``."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The whole weight's shape."""

    @property
    def components(self) -> tuple[str, ...]:
        """Names of the per-group component tensors, in the order :meth:`parts` returns them."""

    @property
    def checksum_names(self) -> tuple[str, ...]:
        """Names of what :meth:`checksum` covers, three integers each."""

    @property
    def numel(self) -> int:
        """Elements of the whole weight."""

    @property
    def group_numel(self) -> int:
        """Elements of one group: the smallest piece that is a weight of this format by itself."""

    @property
    def groups(self) -> int:
        """Groups in the whole weight (:attr:`numel` / :attr:`group_numel`)."""

    def describe(self) -> str:
        """Shape and block structure, for messages."""

    def requantize_hint(self) -> str:
        """How a user makes a fresh, consistent weight of this format."""

    def release_owner(self, module: nn.Module) -> None:
        """Drop what ``module`` (an owner of the weight) keeps of the whole weight's state besides the weight."""

    def component_numels(self, groups: int) -> tuple[int, ...]:
        """Elements of each component for ``groups`` groups."""

    def component_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtype of each component, in :attr:`components` order."""

    def parts(self, tensor: Any, start: int, count: int) -> tuple[torch.Tensor, ...]:
        """The components of groups ``[start, start + count)`` of ``tensor`` (flat views)."""

    def build(self, parts: tuple[torch.Tensor, ...], *, shape: tuple[int, ...] | None = None) -> nn.Parameter:
        """A frozen weight of this format (or the 1-D piece ``shape``) from its component ``parts``."""

    def problems(self, tensor: object, *, groups: int) -> list[str]:
        """How ``tensor`` fails to be a piece of ``groups`` groups of this layout (empty if it is one)."""

    def checksum(self, tensor: Any) -> tuple[int, ...]:
        """A checksum of ``tensor``'s components and shared state (see :func:`byte_checksum`)."""


def byte_checksum(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Three integers per tensor: its byte count, the sum of its bytes, and their sum weighted by position.

    The weight is the position mod 65521, plus one, so a zeroed, replaced or shifted tensor
    changes it. Computed where the tensors live. Compared, not stored: any change of the formula
    only has to agree within one process.
    """
    out: list[int] = []
    for tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        plain = weighted = 0
        chunk = 1 << 22
        for start in range(0, raw.numel(), chunk):
            piece = raw[start : start + chunk].to(torch.int64)
            weights = (torch.arange(start, start + piece.numel(), device=piece.device) % 65521) + 1
            plain += int(piece.sum())
            weighted += int((piece * weights).sum())
        out += [raw.numel(), plain, weighted]
    return tuple(out)
