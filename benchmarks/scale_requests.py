"""The object-store requests of a simulated save and verified load, for ``benchmarks/scale_sim.py``: counted from the
store's operations (computed, not sent), and the floor they put on a save or load at S3's per-prefix request rates.
"""

from __future__ import annotations

from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.storage.key_prefixes import rank_of, spread_prefix

__all__ = ["GET_PER_S", "PUT_PER_S", "READ_BLOCK", "UPLOAD_PART", "object_store_requests"]

READ_BLOCK = 8 << 20  # a verified load's ranged GETs (storage/objects.py: ObjectPath.open, block_size)


def _upload_part() -> int:
    """The part size of the store's uploads: s3fs's default block size (``object_store.py`` opens files with it)."""
    try:
        import s3fs

        return int(s3fs.S3FileSystem.default_block_size)
    except ImportError:  # the object-store extra is not installed: s3fs's documented default
        return 50 << 20


UPLOAD_PART = _upload_part()
PUT_PER_S, GET_PER_S = 3500, 5500  # S3's documented request rates per prefix


def object_store_requests(
    digests: list[FileDigest], records: dict[str, int], world: int, *, spread: bool = True
) -> dict[str, float]:
    """Requests a save and a verified load make under the checkpoint's prefixes (``scale_sim``'s module note).

    ``spread``: the data files under ``shards/GGGG/`` as a bucket save puts them (``key_prefixes.py``; the floors
    are the fullest prefix's requests, the prefixes served in parallel once the store has partitioned them);
    False: every object under one prefix, as before that layout.
    """

    def puts(size: int) -> int:
        return 1 if size <= UPLOAD_PART else 2 + -(-size // UPLOAD_PART)  # initiate + parts + complete

    def gets(size: int) -> int:
        return max(1, -(-size // READ_BLOCK))

    def prefix(d: FileDigest) -> str:
        rank = rank_of(d.path)
        return spread_prefix(rank).rsplit("/", 1)[0] if spread and rank is not None else ""

    top = [*records.values(), *(d.bytes for d in digests if not prefix(d))]
    folders: dict[str, list[int]] = {"": top}
    for d in digests:
        if prefix(d):
            folders.setdefault(prefix(d), []).append(d.bytes)
    objects = len(digests) + len(records)
    # claim (conditional PUT), listing of the parent for the newest committed, claim deleted after the commit:
    # beside the checkpoint, counted with its top prefix; a verified load lists every object (1,000 a page) there
    save = {name: sum(puts(s) for s in sizes) + (3 if not name else 0) for name, sizes in folders.items()}
    listing = -(-objects // 1000)
    load = {name: sum(gets(s) for s in sizes) + (listing if not name else 0) for name, sizes in folders.items()}
    return {
        "objects_per_prefix": max(len(sizes) for sizes in folders.values()),
        "prefixes": len(folders),
        "save_requests": sum(save.values()),
        "save_requests_per_prefix": max(save.values()),
        "save_floor_s": max(save.values()) / PUT_PER_S,
        "load_requests": sum(load.values()),
        "load_requests_per_prefix": max(load.values()),
        "load_floor_s": max(load.values()) / GET_PER_S,
    }
