"""The protocol's costs beside the commit and the plans, for ``benchmarks/scale_sim.py``: rank 0's listing check
before the commit, the checked manifest each rank receives, and the elastic restart's agreement on restart counts.

Each runs shardline's code on what W ranks would hand it; no process group:

* **Listing check (rank 0)**: ``save._check_listing`` over a real temporary directory holding W x ``files`` empty
  data files and ``.metadata`` (created first, not timed), against the digests the ranks reported.
* **Manifest broadcast**: ``load._checked`` has rank 0 check the manifest and send ``CheckedManifest.to_json()``
  to every rank through ``coord.rank0_decides``; timed here are rank 0's encoding of the whole checked manifest
  (``to_json`` and ``coord._encode``, what ``broadcast_object`` sends for ``check_checkpoint``, which returns it
  on every rank) and each rank's decoding of it (``coord._decode`` and ``CheckedManifest.from_json``).
* **Manifest at a load, per rank**: what a load's rank other than 0 receives of the manifest: the broadcast
  message (``to_json(whole=False)``: ``.metadata``'s entry and the manifest's hash) and its share of the data
  files' entries, pickled in its DCP load plan (the largest share ``VerifyingReader.prepare_global_plan`` gave
  in ``scale_sim``'s load: each rank its own files, at the same world size and layout).
* **Restart count**: the elastic restart's one all-reduce (MAX) of an int64 (``coord.max_over_ranks``, which
  ``train/worker.py`` and ``train/checkpointing.py`` call): 8 bytes received per rank, nothing to decode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _manifest_broadcast(
    root: Path, manifest: bytes, digest: str, share_bytes: int, timed: Timer, reps: int
) -> dict[str, float]:
    folder = root / "broadcast"
    folder.mkdir()
    (folder / MANIFEST).write_bytes(manifest)
    (folder / MANIFEST_HASH_FILE).write_text(f"{digest}  {MANIFEST}\n")
    checked = check_manifest(folder, level=VerifyLevel.NONE)  # what rank 0 holds once it has checked it
    t_send, data = timed(lambda: coord._encode({"value": checked.to_json()}), reps)
    t_receive, got = timed(lambda: CheckedManifest.from_json(coord._decode(data)["value"]), reps)
    assert got.manifest == checked.manifest
    at_load = coord._encode({"value": checked.to_json(whole=False)})  # what a load broadcasts
    return {
        "manifest_broadcast_bytes": len(data),
        "manifest_broadcast_rank0_s": t_send,
        "manifest_receive_per_rank_s": t_receive,
        "manifest_load_bytes_per_rank": len(at_load) + share_bytes,
    }


def _restart_count() -> dict[str, float]:
    return {"restart_count_bytes_per_rank": 8}  # one int64, all-reduced (MAX), whatever the world size


def side_costs(
    root: Path,
    digests: list[FileDigest],
    manifest: bytes,
    digest: str,
    *,
    share_bytes: int,
    timed: Timer,
    reps: int,
) -> dict[str, float]:
    """The three costs (see the module note); ``digests``: every file the ranks reported; ``share_bytes``: the
    largest share of the data files' entries the coordinator put in a rank's load plan (pickled)."""
    return {
        **_listing(root, digests, timed, reps),
        **_manifest_broadcast(root, manifest, digest, share_bytes, timed, reps),
        **_restart_count(),
    }
