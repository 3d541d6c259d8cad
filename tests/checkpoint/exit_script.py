"""Launched by tests/checkpoint/test_exit.py as one rank of a 2-process gloo job: ends its interpreter while an
async save is still writing, as a script does that returns without ``CheckpointManager.wait()`` or ``close()``.

``python exit_script.py RANK RENDEZVOUS_FILE CHECKPOINT_DIR``. Rank 1's first file write is held for a second,
so both ranks' background writes are mid-save (rank 0 inside a collective, waiting for rank 1) when their
main threads return.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import shardline.checkpoint as ckpt
from shardline.checkpoint.faults.observer import SaveObserver


class _SlowFirstWrite(SaveObserver):
    def __init__(self) -> None:
        self.held = False

    def before_write(self, path: str, nbytes: int, rank: int) -> None:
        if not self.held:
            self.held = True
            time.sleep(1.0)


def main() -> None:
    rank, rendezvous, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    observer = _SlowFirstWrite() if rank == 1 else None
    manager = ckpt.CheckpointManager(directory, async_save=True, observer=observer)
    manager.save(ckpt.SaveRequest(step=1, model=model))
    print(f"rank {rank}: staged, leaving", flush=True)


if __name__ == "__main__":
    main()
