"""Test utilities for code built on shardline (multi-process runs with hard deadlines, injected faults)."""

from shardline.testing.collectives import DelayedCollectives, FaultyCollectives, GradientFault
from shardline.testing.multiprocess import DistributedTimeoutError, RankFailedError, rank_device, run_distributed

__all__ = [
    "DelayedCollectives",
    "DistributedTimeoutError",
    "FaultyCollectives",
    "GradientFault",
    "RankFailedError",
    "rank_device",
    "run_distributed",
]
