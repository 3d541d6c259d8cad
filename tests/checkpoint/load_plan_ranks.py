"""Rank functions for tests/checkpoint/test_load_planner.py (module level, so the harness can pickle them)."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import shardline.checkpoint as ckpt
from shardline import _torch_compat
from shardline.checkpoint.format import load_planner
from tests.checkpoint import ranks, zero_ranks


def save_then_load(rank: int, world: int, path: str, strategy: str) -> tuple[bytes, bytes, list[tuple[str, str]], int]:
    """Save a trained model, load it into a fresh one at the same world size and strategy (hybrid: a (W/2, 2)
    mesh): what torch's planner planned, and how many pieces were read by their box."""
    expected = zero_ranks.train_and_save(rank, world, path, strategy, 2)
    by_torch: list[tuple[str, str]] = []
    exact = [0]
    real_torch, real_exact = _torch_compat.read_items_by_torch, load_planner._exact_item

    def torch_planned(fqn: str, saved: object, value: object) -> Any:
        tensor = isinstance(saved, TensorStorageMetadata) and len(saved.size) > 0
        by_torch.append((fqn, "tensor" if tensor else "other"))
        return real_torch(fqn, saved, value)

    def exact_item(*args: Any) -> Any:
        exact[0] += 1
        return real_exact(*args)

    _torch_compat.read_items_by_torch = torch_planned  # type: ignore[assignment]
    load_planner._exact_item = exact_item  # type: ignore[assignment]
    try:
        model, optimizer = zero_ranks.build(strategy, seed=123)
        ckpt.load(path, model=model, optimizer=optimizer)
    finally:
        _torch_compat.read_items_by_torch = real_torch  # type: ignore[assignment]
        load_planner._exact_item = real_exact  # type: ignore[assignment]
    return expected, ranks.snapshot(model, optimizer), by_torch, exact[0]
