"""Test utilities for code built on shardline (multi-process runs with hard deadlines, injected faults).

Checkpoint test hooks: a :class:`SaveObserver` sees a save's phases and writes; :class:`KillAtPhase` ends a rank at
a phase (exit code :data:`FAULT_EXIT_CODE`), :class:`FailWrites` fails its writes like a full disk; the named crash
points of the commit protocol (:data:`CRASH_POINTS`) end a process with :data:`CRASH_EXIT_CODE` once armed.
"""

from shardline.checkpoint.faults.crashpoints import CRASH_EXIT_CODE, CRASH_POINTS
from shardline.checkpoint.faults.crashpoints import arm as arm_crash_point
from shardline.checkpoint.faults.crashpoints import disarm as disarm_crash_points
from shardline.checkpoint.faults.crashpoints import trace as trace_crash_points
from shardline.checkpoint.faults.crashpoints import traced as traced_crash_points
from shardline.checkpoint.faults.fault import FAULT_EXIT_CODE, FailWrites, KillAtPhase
from shardline.checkpoint.faults.observer import SaveObserver, SavePhase
from shardline.testing.collectives import DelayedCollectives, FaultyCollectives, GradientFault
from shardline.testing.multiprocess import DistributedTimeoutError, RankFailedError, rank_device, run_distributed

__all__ = [
    "CRASH_EXIT_CODE",
    "CRASH_POINTS",
    "FAULT_EXIT_CODE",
    "DelayedCollectives",
    "DistributedTimeoutError",
    "FailWrites",
    "FaultyCollectives",
    "GradientFault",
    "KillAtPhase",
    "RankFailedError",
    "SaveObserver",
    "SavePhase",
    "arm_crash_point",
    "disarm_crash_points",
    "rank_device",
    "run_distributed",
    "trace_crash_points",
    "traced_crash_points",
]
