"""Deterministic batches of a token stream, split across ranks and micro-batches.

Both kinds are stateless: the batch of step ``s`` depends only on ``(seed, s)``, so resuming at
step ``s`` continues exactly where an uninterrupted run would be, and the data position of a
run is its step. The global batch of a step is cut in ``world_size`` contiguous slices, one per
rank, so one process with the whole global batch sees exactly the union of what ``W`` ranks see.
"""

from __future__ import annotations

import torch

from shardline.errors import ConfigurationError
from shardline.train.data.corpus import Corpus, TokenStream, stream_length, take_windows

__all__ = ["Batches", "PackedBatches", "make_batches"]


def _check(data: TokenStream, *, seq_len: int, global_batch: int, world_size: int, unit: str) -> None:
    if global_batch % world_size:
        raise ConfigurationError(
            f"the global batch ({global_batch}) must be divisible by the number of ranks ({world_size}); "
            "change trainer.micro_batch_size, trainer.accumulate_grad_batches or trainer.devices"
        )
    if stream_length(data) <= seq_len + 1:
        raise ConfigurationError(
            f"the corpus split has {stream_length(data)} {unit}, fewer than seq_len+1={seq_len + 1}; "
            "use more data or a smaller data.seq_len"
        )


class _GlobalBatchSlices:
    """What both batch kinds share: the stream, the window length, and this rank's slice of the global batch."""

    _unit = "tokens"

    def __init__(
        self, data: TokenStream, *, seq_len: int, global_batch: int, rank: int, world_size: int, seed: int
    ) -> None:
        _check(data, seq_len=seq_len, global_batch=global_batch, world_size=world_size, unit=self._unit)
        self.data = data
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.rank = rank
        self.seed = seed


class Batches(_GlobalBatchSlices):
    """Random windows: ``global_batch`` windows of ``seq_len + 1`` tokens at offsets drawn from ``(seed, step)``.

    Used for the built-in corpus. Rank ``r`` takes the ``r``-th contiguous slice of the global batch.
    """

    _unit = "bytes"

    def starts(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = stream_length(self.data) - self.seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=g)

    def local(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` for ``step``, each ``(local_batch, seq_len)`` int64."""
        starts = self.starts(step)[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]
        windows = take_windows(self.data, starts, self.seq_len + 1)
        return windows[:, :-1], windows[:, 1:]


class PackedBatches(_GlobalBatchSlices):
    """Packed fixed windows: the stream (documents joined by a separator) cut into consecutive windows.

    Window ``i`` holds tokens ``[i * seq_len, (i + 1) * seq_len]`` (``seq_len + 1`` tokens: inputs
    and targets shifted by one), so every token is trained on once per epoch and no window is
    padded. Each epoch visits all windows in an order drawn from ``(seed, epoch)``; step ``s``
    takes the next ``global_batch`` of them (running into the next epoch when one ends), and
    rank ``r`` its ``r``-th contiguous slice.
    """

    def __init__(
        self, data: TokenStream, *, seq_len: int, global_batch: int, rank: int, world_size: int, seed: int
    ) -> None:
        super().__init__(data, seq_len=seq_len, global_batch=global_batch, rank=rank, world_size=world_size, seed=seed)
        self.windows = (stream_length(data) - 1) // seq_len
        self._orders: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        """The window order of ``epoch`` (a permutation of ``range(self.windows)``)."""
        order = self._orders.get(epoch)
        if order is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7_919 * epoch + 1)
            order = torch.randperm(self.windows, generator=g)
            self._orders = {epoch: order}  # steps move forward: keep only the current epoch
        return order

    def window_ids(self, step: int) -> torch.Tensor:
        """The windows of this rank's slice of step ``step``."""
        first = step * self.global_batch + self.rank * self.local_batch
        positions = range(first, first + self.local_batch)
        return torch.tensor([int(self.order(p // self.windows)[p % self.windows]) for p in positions])

    def epoch(self, step: int) -> float:
        """Epochs completed at the start of ``step`` (fractional)."""
        return step * self.global_batch / self.windows

    def local(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` for ``step``, each ``(local_batch, seq_len)`` int64."""
        windows = take_windows(self.data, self.window_ids(step) * self.seq_len, self.seq_len + 1)
        return windows[:, :-1], windows[:, 1:]


def make_batches(
    corpus: Corpus, split: str, *, seq_len: int, global_batch: int, rank: int, world_size: int, seed: int
) -> Batches | PackedBatches:
    """The batches of ``corpus``'s ``"train"`` or ``"val"`` split (packed windows unless the corpus says otherwise)."""
    data = corpus.train if split == "train" else corpus.val
    cls = PackedBatches if corpus.packed else Batches
    return cls(data, seq_len=seq_len, global_batch=global_batch, rank=rank, world_size=world_size, seed=seed)
