"""Deterministic batches of a token stream, split across ranks and micro-batches.

Note: the sample stream is defined globally. A step's global batch is a list of *sample ids*
(:meth:`sample_ids`) that depends only on ``(seed, step, global batch)`` -- never on the world
size -- and a sample id maps to one window of the stream (:meth:`windows`). Rank ``r`` of ``W``
takes the ``r``-th contiguous slice of the step's ids, so one process with the whole global
batch sees exactly the union of what ``W`` ranks see, and a restart at another world size (the
global batch is invariant, :mod:`shardline.train.global_batch`) continues with the very samples
an uninterrupted run would train on: none skipped, none repeated. The data position of a run is
its step. :func:`batch_digest` names a step's samples in a few hex digits (``metrics.csv``'s
``data_digest``), equal for a step at every world size. A new data source plugs in by giving
its samples ids and windows; the slicing and the digest stay here.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import torch

from shardline.errors import ConfigurationError
from shardline.train.data.corpus import Corpus, TokenStream, stream_length, take_windows

__all__ = ["Batches", "PackedBatches", "batch_digest", "make_batches"]

DIGEST_HEX = 16
"""Hex digits of a :func:`batch_digest`."""


def batch_digest(sample_ids: torch.Tensor) -> str:
    """A short hash of a global batch's sample ids, in order (the same for a step at every world size)."""
    data = sample_ids.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:DIGEST_HEX]


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


class _GlobalBatchSlices(ABC):
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

    @abstractmethod
    def sample_ids(self, step: int) -> torch.Tensor:
        """The global batch of ``step``: ``global_batch`` sample ids (int64), whatever the world size."""

    @abstractmethod
    def sample_windows(self, ids: torch.Tensor) -> torch.Tensor:
        """The ``(len(ids), seq_len + 1)`` token windows of sample ``ids``."""

    def identities(self, ids: torch.Tensor) -> torch.Tensor:
        """What names each sample's data (what :meth:`digest` hashes): the ids themselves unless a kind says."""
        return ids

    def local_ids(self, step: int) -> torch.Tensor:
        """This rank's contiguous slice of ``step``'s sample ids."""
        return self.sample_ids(step)[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]

    def digest(self, step: int) -> str:
        """:func:`batch_digest` of ``step``'s global batch."""
        return batch_digest(self.identities(self.sample_ids(step)))

    def local(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` for ``step``, each ``(local_batch, seq_len)`` int64."""
        windows = self.sample_windows(self.local_ids(step))
        return windows[:, :-1], windows[:, 1:]


class Batches(_GlobalBatchSlices):
    """Random windows: ``global_batch`` windows of ``seq_len + 1`` tokens at offsets drawn from ``(seed, step)``.

    Used for the built-in corpus. A sample's id is its window's offset in the stream.
    """

    _unit = "bytes"

    def starts(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = stream_length(self.data) - self.seq_len - 1
        return torch.randint(0, high, (self.global_batch,), generator=g)

    def sample_ids(self, step: int) -> torch.Tensor:
        return self.starts(step)

    def sample_windows(self, ids: torch.Tensor) -> torch.Tensor:
        return take_windows(self.data, ids, self.seq_len + 1)


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

    def sample_ids(self, step: int) -> torch.Tensor:
        """Global positions ``step * global_batch ...`` of the epoch-shuffled window sequence.

        A sample's id is its global position (epoch x windows + index), so a window seen again in a
        later epoch is another sample.
        """
        first = step * self.global_batch
        return torch.arange(first, first + self.global_batch, dtype=torch.int64)

    def sample_windows(self, ids: torch.Tensor) -> torch.Tensor:
        return take_windows(self.data, self.window_ids_of(ids) * self.seq_len, self.seq_len + 1)

    def identities(self, ids: torch.Tensor) -> torch.Tensor:
        """``epoch x windows + window``: the window read, and in which epoch."""
        return (ids // self.windows) * self.windows + self.window_ids_of(ids)

    def window_ids_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The window each global position reads."""
        return torch.tensor([int(self.order(p // self.windows)[p % self.windows]) for p in positions.tolist()])

    def window_ids(self, step: int) -> torch.Tensor:
        """The windows of this rank's slice of step ``step``."""
        return self.window_ids_of(self.local_ids(step))

    def epoch(self, step: int) -> float:
        """Epochs completed at the start of ``step`` (fractional)."""
        return step * self.global_batch / self.windows


def make_batches(
    corpus: Corpus, split: str, *, seq_len: int, global_batch: int, rank: int, world_size: int, seed: int
) -> Batches | PackedBatches:
    """The batches of ``corpus``'s ``"train"`` or ``"val"`` split (packed windows unless the corpus says otherwise)."""
    data = corpus.train if split == "train" else corpus.val
    cls = PackedBatches if corpus.packed else Batches
    return cls(data, seq_len=seq_len, global_batch=global_batch, rank=rank, world_size=world_size, seed=seed)
