"""Where a save puts its data files: flat on disk, spread over key prefixes in an object store.

Note: why a bucket save spreads its data files, and how. S3 documents its request rates per
partitioned key prefix -- about 3,500 PUT/s and 5,500 GET/s -- and answers a faster burst with
``503 Slow Down`` while it splits the prefix. A flat checkpoint puts every ``__R_N.distcp`` under
``step-N/``: at 16,384 ranks x 8 files, 131k PUTs under one prefix, a 37.5 s floor on the save
however many ranks upload at once. So in a bucket, the data files of a new save go under
``shards/GGGG/`` (``GGGG`` = rank // :data:`RANKS_PER_PREFIX`, four digits): 256 ranks per prefix,
64 prefixes at 16,384 ranks, at most ``256 x files_per_rank`` objects each (2,048 at 8 files:
0.6 s of PUTs at 3,500/s, all prefixes in parallel once S3 has partitioned them).

* A block of ranks, not a hash of the rank: every group is exactly full (a hash spreads ranks
  unevenly, and the fullest group sets the floor); a node's ranks (consecutive) share a group,
  so a listing of a group shows what a node wrote; the groups are sorted, so a listing reads in
  rank order. S3 scales per prefix and splits a busy one where its keys differ -- here right
  after ``shards/`` -- so distinct prefixes are enough: since 2018 it no longer asks for random
  leading characters. GCS and Azure Blob partition by key range too and split a range under load
  (GCS asks for a gradual ramp and warns that sequential names concentrate writes in one range);
  there a hash would spread a cold start better, at the cost of the even groups and of the
  locality above -- a few thousand objects per group bounds each range's load either way.
* Nothing a reader needs comes from this module: the relative path of every data file is
  recorded in DCP's ``.metadata`` (``storage_data``) and in the manifest, so a reader follows
  what the checkpoint says, and a checkpoint saved with another group size (or flat, before
  this layout, or on disk) reads unchanged. The rank of a file comes from its name
  (``__R_N.distcp``), whatever folder holds it.
* On disk a directory of 131k files costs nothing per name, and every tool (``ls``, ``du``,
  ``sha256sum -c``) reads a flat directory most simply: local saves stay flat. Which layout a
  save uses is the store's answer (:meth:`.SaveFiles.data_prefix`), never a caller's branch.
"""

from __future__ import annotations

import posixpath
import re

__all__ = [
    "RANKS_PER_PREFIX",
    "SHARDS_FOLDER",
    "flat_prefix",
    "max_objects_per_prefix",
    "rank_of",
    "spread_prefix",
]

RANKS_PER_PREFIX = 256
"""Ranks whose data files share one key prefix in a bucket (see the module note)."""

SHARDS_FOLDER = "shards"
"""The folder of a bucket checkpoint that holds the data files' prefixes."""

_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def flat_prefix(rank: int) -> str:
    """DCP's own file-name prefix of ``rank``'s data files, in the checkpoint's top folder (``__R_``)."""
    return f"__{rank}_"


def spread_prefix(rank: int) -> str:
    """The file-name prefix of ``rank``'s data files spread over key prefixes: ``shards/GGGG/__R_``."""
    return f"{SHARDS_FOLDER}/{rank // RANKS_PER_PREFIX:04d}/{flat_prefix(rank)}"


def rank_of(path: str) -> int | None:
    """The rank that wrote the data file at ``path`` (``__R_N.distcp``, in any folder), or None for another file."""
    match = _DATA_FILE.match(posixpath.basename(path))
    return int(match.group(1)) if match else None


def max_objects_per_prefix(*, world: int, files_per_rank: int, spread: bool) -> int:
    """The most data files a save of ``world`` ranks x ``files_per_rank`` puts under one key prefix."""
    ranks = min(world, RANKS_PER_PREFIX) if spread else world
    return ranks * files_per_rank
