"""``.metadata`` is unpickled without the cyclic garbage collector walking the heap for every few hundred records."""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardline.checkpoint.format.dcp_io import unpickle_metadata
from shardline.errors import IntegrityError


def _metadata_bytes(ranks: int, tensors: int) -> bytes:
    """A ``.metadata`` of ``tensors`` tensors, each with one row chunk per rank, as DCP pickles it."""
    items, storage = {}, {}
    for n in range(tensors):
        fqn = f"model.layers.{n}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 8])) for r in range(ranks)]
        items[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([ranks, 8]), chunks)
        for r, chunk in enumerate(chunks):
            storage[MetadataIndex(fqn, chunk.offsets)] = _StorageInfo(f"__{r}_0.distcp", n * 32, 32)
    return pickle.dumps(Metadata(state_dict_metadata=items, storage_data=storage))


@pytest.fixture
def collections() -> Iterator[list[int]]:
    seen = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen[0] += 1

    gc.callbacks.append(count)
    try:
        yield seen
    finally:
        gc.callbacks.remove(count)


def test_no_collection_runs_while_the_metadata_is_built(collections: list[int]) -> None:
    data = _metadata_bytes(ranks=2048, tensors=20)  # 41k chunks and as many storage records
    assert gc.isenabled()
    gc.collect()  # the allocation counts start from zero: none is due in the call's first few allocations
    collections[0] = 0
    metadata = unpickle_metadata(data, ".metadata")
    # at most the one the allocations made meanwhile set off once the collector is on again; with it on throughout:
    # a thousand, each walking the young objects and some every object alive
    assert collections[0] <= 1, collections[0]
    assert gc.isenabled()  # and it is on again
    plain = pickle.loads(data)
    assert (metadata.state_dict_metadata, metadata.storage_data) == (plain.state_dict_metadata, plain.storage_data)


def test_the_collector_is_left_as_it_was_found_and_after_an_error() -> None:
    data = _metadata_bytes(ranks=4, tensors=2)
    gc.disable()
    try:
        unpickle_metadata(data, ".metadata")
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()
    with pytest.raises(IntegrityError, match="cannot be read"):
        unpickle_metadata(data[: len(data) // 2], ".metadata")
    assert gc.isenabled()
