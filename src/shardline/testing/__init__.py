"""Test utilities for code built on shardline (multi-process runs with hard deadlines)."""

from shardline.testing.multiprocess import DistributedTimeoutError, RankFailedError, run_distributed

__all__ = ["DistributedTimeoutError", "RankFailedError", "run_distributed"]
