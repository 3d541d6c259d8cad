"""The protocol's costs beside the commit and the plans, for ``benchmarks/scale_sim.py``: rank 0's listing check
before the commit, the checked manifest's broadcast at a load, and the elastic restart's gather of restart counts.

Each runs shardline's code (or, for the restart gather, the receiving half of torch's ``all_gather_object`` that
``train/worker.py`` and ``train/checkpointing.py`` call) on what W ranks would hand it; no process group:

* **Listing check (rank 0)**: ``save._check_listing`` over a real temporary directory holding W x ``files`` empty
  data files and ``.metadata`` (created first, not timed), against the digests the ranks reported.
* **Manifest broadcast**: ``load._checked`` has rank 0 check the manifest and send ``CheckedManifest.to_json()``
  to every rank through ``coord.rank0_decides``; timed here are rank 0's encoding of that message
  (``to_json`` and ``coord._encode``, what ``broadcast_object`` sends) and each rank's decoding of it
  (``coord._decode`` and ``CheckedManifest.from_json``); the bytes are what every rank receives.
* **Restart gather**: every rank's ``all_gather_object`` of its ``TORCHELASTIC_RESTART_COUNT``: the sizes
  (one int64 per rank) and the pickled counts padded to the largest, then one ``_tensor_to_object`` per rank
  and the maximum -- what every rank, rank 0 included, does with what it received.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.manifest import MANIFEST, MANIFEST_HASH_FILE
from shardline.checkpoint.integrity.opening import CheckedManifest, check_manifest
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle import save
from shardline.checkpoint.storage.stores import locate

__all__ = ["side_costs"]

Timer = Callable[[Callable[[], Any], int], tuple[float, Any]]


def _listing(root: Path, digests: list[FileDigest], timed: Timer, reps: int) -> dict[str, float]:
    tmp = root / "listing.tmp"
    tmp.mkdir()
    for d in digests:
        (tmp / d.path).touch()
    t, _ = timed(lambda: save._check_listing(locate(tmp), digests), reps)
    return {"listing_entries": len(digests), "listing_check_s": t}


def _manifest_broadcast(root: Path, manifest: bytes, digest: str, timed: Timer, reps: int) -> dict[str, float]:
    folder = root / "broadcast"
    folder.mkdir()
    (folder / MANIFEST).write_bytes(manifest)
    (folder / MANIFEST_HASH_FILE).write_text(f"{digest}  {MANIFEST}\n")
    checked = check_manifest(folder, level=VerifyLevel.NONE)  # what rank 0 holds once it has checked it
    t_send, data = timed(lambda: coord._encode({"value": checked.to_json()}), reps)
    t_receive, got = timed(lambda: CheckedManifest.from_json(coord._decode(data)["value"]), reps)
    assert got.manifest == checked.manifest
    return {
        "manifest_broadcast_bytes": len(data),
        "manifest_broadcast_rank0_s": t_send,
        "manifest_receive_per_rank_s": t_receive,
    }


def _restart_gather(world: int, timed: Timer, reps: int) -> dict[str, float]:
    payload, size = c10d._object_to_tensor(3, torch.device("cpu"), None)  # one rank's count, pickled
    width = int(size.item())
    received = torch.empty(world * width, dtype=torch.uint8)
    for r in range(world):
        received[r * width : (r + 1) * width] = payload
    sizes = torch.full((world,), width, dtype=torch.long)

    def every_count() -> int:  # all_gather_object around its two all_gathers, then the job's maximum
        size_list = [sizes[r].unsqueeze(dim=0) for r in range(world)]  # the sizes' all_gather lands here
        longest = int(max(size_list).item())  # type: ignore[type-var]  # as torch takes it
        views = [received[longest * r : longest * (r + 1)] for r in range(world)]  # the objects' all_gather output
        counts = [c10d._tensor_to_object(t.type(torch.uint8), size_list[r], None) for r, t in enumerate(views)]
        return max(int(c) for c in counts)

    t, restart = timed(every_count, reps)
    assert restart == 3
    return {"restart_gather_bytes_per_rank": world * (8 + width), "restart_gather_per_rank_s": t}


def side_costs(
    root: Path, digests: list[FileDigest], manifest: bytes, digest: str, *, world: int, timed: Timer, reps: int
) -> dict[str, float]:
    """The three costs at ``world`` ranks (see the module note); ``digests``: every file the ranks reported."""
    return {
        **_listing(root, digests, timed, reps),
        **_manifest_broadcast(root, manifest, digest, timed, reps),
        **_restart_gather(world, timed, reps),
    }
