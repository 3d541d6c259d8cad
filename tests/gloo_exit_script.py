"""Launched by tests/test_gloo_exit.py as one rank of a 2-process gloo job that ends the way
examples/torchtitan_style_checkpoint.py and the Hugging Face ``fsdp=`` runs end: collectives up to the last
lines, ``destroy_process_group()``, exit, while something still references the group (there, DTensor's sharding
cache, which keeps every mesh it saw and so its groups; here a module-level list).

``python gloo_exit_script.py RANK RENDEZVOUS_FILE``. The GIL switch interval is raised to 30 s, so a gloo worker
waiting for the GIL to drop its last collective's tensors never asks the main thread for it: it gets the GIL
only when the main thread lets it go, which before the fix happened first while the interpreter was tearing down.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import shardline  # noqa: F401  (a script that uses shardline imports it)

_KEPT: list[object] = []


def main() -> None:
    rank, rendezvous = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    _KEPT.append(dist.group.WORLD)
    sys.setswitchinterval(30.0)
    total = torch.full((4,), float(rank))
    for _ in range(3):
        dist.all_reduce(total)
    dist.destroy_process_group()
    print(f"rank {rank}: summed {total.tolist()}")


if __name__ == "__main__":
    main()
