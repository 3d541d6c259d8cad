"""How many files a rank writes per checkpoint, and how many threads hash them.

Note: why several files per rank. SHA-256 runs at about 1.5 GB/s on one core, slower than
the page cache takes a write or gives a read. With one file per rank, a rank's hashing is one
stream on one core, and it bounds both the save and the verified load from below. Written as
several files (DCP's ``thread_count``: the rank's items are spread over the files by size),
each file is written and hashed by its own writer thread and, on load, read and hashed on its
own thread, so a rank with spare cores hashes its share on several of them at once. Every file
keeps its own SHA-256 in the manifest, so ``sha256sum -c SHA256SUMS`` still checks each one.

The automatic count is the cores this process may run on divided among the ranks of its node
(``LOCAL_WORLD_SIZE``, set by torchrun and by :func:`shardline.testing.run_distributed`; the
world size when it is missing, which undercounts on several nodes but never oversubscribes),
at most :data:`MAX_FILES_PER_RANK`, and no more files than the rank has
:data:`MIN_AUTO_FILE_BYTES` of data (:func:`files_for_share`): a small share gains nothing from
being split, and each file costs an open and an fsync. The number of files changes nothing a loader sees: DCP's
metadata says which file holds each item, so a checkpoint loads at any world size and file
count.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from shardline.errors import ConfigurationError

__all__ = [
    "AUTO",
    "MAX_FILES_PER_RANK",
    "MIN_AUTO_FILE_BYTES",
    "available_cores",
    "cores_per_rank",
    "files_for_share",
    "resolve_files_per_rank",
]

AUTO = 0
"""``files_per_rank`` value that asks for the automatic count."""
MAX_FILES_PER_RANK = 8
"""The automatic count's ceiling: beyond it, more files only add opens and fsyncs."""
MIN_AUTO_FILE_BYTES = 16 << 20
"""The automatic count gives each file at least this much of the rank's data."""


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cores_per_rank() -> int:
    """The cores this process may use, shared among the ranks on its node (at least 1)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip().isdigit() and int(local) > 0:
        ranks = int(local)
    else:
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return max(1, available_cores() // ranks)


def resolve_files_per_rank(files_per_rank: int) -> int:
    """The number of files each rank writes: ``files_per_rank`` itself, or the automatic count for 0.

    Raises:
        ConfigurationError: ``files_per_rank`` is negative or not an integer.
    """
    if isinstance(files_per_rank, bool) or not isinstance(files_per_rank, int) or files_per_rank < 0:
        raise ConfigurationError(
            f"files_per_rank={files_per_rank!r} is not a file count; use a positive integer, or 0 for the automatic "
            "count (the cores each rank has on its node)"
        )
    if files_per_rank == AUTO:
        return min(MAX_FILES_PER_RANK, cores_per_rank())
    return files_per_rank


def files_for_share(files_per_rank: int, *, share_bytes: int, items: int) -> int:
    """The files a rank writes for ``share_bytes`` in ``items`` items (never more files than items, at least 1).

    ``files_per_rank`` as given, or for 0 (automatic) the cores each rank has, at most one file
    per :data:`MIN_AUTO_FILE_BYTES` of the share.
    """
    count = resolve_files_per_rank(files_per_rank)
    if files_per_rank == AUTO:
        count = min(count, share_bytes // MIN_AUTO_FILE_BYTES)
    return max(1, min(count, items))
