"""A save that fills a real, small file system (run inside its own mount namespace by test_full_disk.py).

``python -m tests.checkpoint.full_disk DIRECTORY LEDGER`` saves step 1 into DIRECTORY (a
directory on a small tmpfs), fills the file system until only about half of that checkpoint's
size is left, then tries step 2 with a synchronous and with an asynchronous save, and prints one
JSON line: the error each raised, what was left in DIRECTORY, and the figures a reader of the
message would check.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardline
import shardline.checkpoint as ckpt
from shardline.testing import run_distributed
from tests.models import Block

DIM, HIDDEN = 256, 1024  # about 2 MiB of fp32 weights per block


def _build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(DIM, HIDDEN), Block(DIM, HIDDEN))
    shardline.wrap(model, shardline.layer_policy(Block))
    return model


def fill_then_save(rank: int, world: int, directory: str, ledger: str) -> dict[str, Any]:
    """Save step 1, fill the file system to about half a checkpoint's room, then save step 2 sync, then async."""
    model = _build()
    root = Path(directory)
    manager = ckpt.CheckpointManager(root, ledger_path=ledger, files_per_rank=2)
    manager.save(ckpt.SaveRequest(step=1, model=model))
    step1 = sum(f.stat().st_size for f in (root / "step-1").iterdir())
    stat = os.statvfs(root)
    with open(root.parent / "filler", "wb") as f:  # on the same file system
        f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - step1 // 2))
    stat = os.statvfs(root)
    out: dict[str, Any] = {"step1_bytes": step1, "free_before": stat.f_bavail * stat.f_frsize}
    for mode in ("sync", "async"):
        manager = ckpt.CheckpointManager(root, ledger_path=ledger, async_save=mode == "async", files_per_rank=2)
        out[mode] = ("no error", "")
        try:
            manager.save(ckpt.SaveRequest(step=2, model=model))
            manager.close()
        except Exception as e:
            out[mode] = (type(e).__name__, str(e))
        out[f"left_after_{mode}"] = sorted(p.name for p in root.iterdir())
    return out


def main(argv: list[str]) -> None:
    directory, ledger = argv
    print(json.dumps(run_distributed(fill_then_save, 1, args=(directory, ledger), timeout=90)[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
