"""The multi-process harness: results come back, failures and hangs surface fast with their stacks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from shardline.testing import DistributedTimeoutError, RankFailedError, run_distributed


def _sum_ranks(rank: int, world_size: int, scale: float) -> tuple[float, str, int]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale, os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_sum_ranks, 3, args=(2.0,)) == [(6.0, "1", 1)] * 3


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("bad value on rank one")
    dist.barrier()  # rank 0 would wait for rank 1 forever without the harness


def test_exception_propagates_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 failed") as info:
        run_distributed(_rank1_raises, 2, timeout=60)
    assert "ValueError: bad value on rank one" in str(info.value)
    assert "_rank1_raises" in info.value.failures[1]  # the traceback names the function
    assert time.monotonic() - start < 20, "a failure must not wait for the deadline"


def _rank0_dies(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(7)
    dist.barrier()


def test_dead_rank_is_reported_with_exit_code() -> None:
    with pytest.raises(RankFailedError, match="rank 0 exited with code 7 without reporting"):
        run_distributed(_rank0_dies, 2, timeout=60)


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_hang_fails_at_the_deadline_with_stacks() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 8s") as info:
        run_distributed(_hangs, 2, timeout=8)
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"took {elapsed:.1f}s"
    assert "in _hangs" in info.value.stacks[0], "the dumped stack shows where the rank was stuck"
