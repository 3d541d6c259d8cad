"""``Reader``: a DCP ``StorageReader`` that verifies a shardline checkpoint before DCP decodes any of it.

``dcp.load(state, storage_reader=Reader("ckpts/step-100"))`` loads a checkpoint written by
``shardline.checkpoint.save`` or :class:`~shardline.checkpoint.lifecycle.dcp_writer.Writer` into a
state dict of the caller's own (torchtitan's ``{"model": ..., "optimizer": ...}``).

Note: where the checks sit in DCP's load, so nothing unverified is decoded and every rank agrees first.

* ``read_metadata`` (every rank): the manifest is anchored and the listing checked
  (``opening.check_manifest``), then ``.metadata`` is hashed against the manifest before it is
  unpickled with DCP's class allowlist (``opening.read_checked_metadata``).
* ``set_up_storage_reader`` (every rank, still in DCP's plan step): at level ``full`` each rank
  hashes its share of the data files (``files[rank::world]``) against the manifest.
* DCP gathers the plan step's errors from every rank before any rank reads data, so a flipped
  byte on one rank's share stops the load on every rank, before a single item is decoded; the
  error is an :class:`~shardline.errors.IntegrityError` naming the file (inside DCP's
  ``CheckpointException``).

Cost: one SHA-256 pass over the checkpoint spread over the ranks, before DCP's own read (the
bytes usually come from the page cache the second time). ``shardline.checkpoint.load`` instead
hashes in the pass that reads, since it installs nothing before the ranks agree.
A check that fails in ``read_metadata`` is held until ``set_up_storage_reader``: DCP would
otherwise retry with rank-local metadata and report only its own "metadata is None".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.opening import (
    CheckedManifest,
    check_manifest,
    integrity_error,
    read_checked_metadata,
)
from shardline.checkpoint.integrity.reading import VerifyingReader
from shardline.checkpoint.integrity.verify import VerifyLevel, check_files
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate
from shardline.errors import CheckpointError, ConfigurationError

__all__ = ["Reader"]


class Reader(StorageReader):
    """A ``torch.distributed.checkpoint`` ``StorageReader`` that verifies the checkpoint before anything is decoded.

    Pass one to ``dcp.load(state, storage_reader=Reader(path))`` on every rank. The world size and layout may
    differ from the save's (DCP reshards).

    Args:
        path: A committed shardline checkpoint (a plain DCP directory only with ``level="none"``), local or a URL.
        level: ``"full"`` (default: every byte hashed against the manifest first), or the opt-ins ``"sizes"``
            and ``"none"``.
        expected_manifest_hash: The manifest hash to trust (e.g. from the ledger); default: ``manifest.sha256``.
        process_group: The group ``dcp.load`` runs over (default: the world); the ranks share the hashing.
        storage_options: Options of the fsspec file system of a URL ``path``.

    After ``read_metadata``, :attr:`manifest_hash` is the checkpoint's manifest hash (pass it as the next
    :class:`Writer`'s ``parent_manifest_hash``).

    Raises:
        ConfigurationError: an unknown level or a malformed expected hash.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        level: VerifyLevel | str = VerifyLevel.FULL,
        expected_manifest_hash: str | None = None,
        process_group: dist.ProcessGroup | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._level = VerifyLevel.parse(level)
        self._expected = expected_manifest_hash
        self._group = process_group
        self._storage_options = storage_options
        self.manifest_hash: str | None = None
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | Location | None = None) -> None:
        """Read another checkpoint (DCP calls this when ``checkpoint_id`` is passed with the reader)."""
        if checkpoint_id is not None:
            self._path = locate(checkpoint_id, storage_options=self._storage_options)
        self._inner: VerifyingReader | None = None
        self._checked: CheckedManifest | None = None
        self._refused: Exception | None = None
        self._world = 1

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint this reader reads (DCP's logging names it)."""
        return str(self._path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP on its own: a user passes it on purpose

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            checked = check_manifest(self._path, level=self._level, expected_manifest_hash=self._expected)
            metadata = read_checked_metadata(checked)
        except Exception as e:  # reported by set_up_storage_reader, inside DCP's plan step (see the module note)
            self._refused = e
            return Metadata(state_dict_metadata={})
        self._checked = checked
        self.manifest_hash = checked.manifest_hash
        self._inner = VerifyingReader(checked.path, metadata, to_hash=())
        return self._inner.read_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._refused is not None:
            raise self._refused
        if self._inner is None or self._checked is None:
            raise CheckpointError(f"reading checkpoint {self._path}: DCP set up the reader before reading its metadata")
        self._inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        rank = int(kwargs.get("rank", coord.group_rank(self._group)) or 0)
        self._world = coord.group_size(self._group)
        if self._level is VerifyLevel.FULL:
            share = self._checked.data_entries()[rank :: self._world]
            problems, _ = check_files(self._checked.path, share, VerifyLevel.FULL)
            if problems:
                raise integrity_error(self._checked.path, problems, what="nothing was decoded from it")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self._inner is not None  # set up by now
        return self._inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        assert self._inner is not None  # set up by now
        if self._level is VerifyLevel.FULL and len(plans) != self._world:
            raise ConfigurationError(
                f"dcp.load runs over {len(plans)} ranks but shardline.checkpoint.Reader shared the hashing of "
                f"{self._path} over {self._world}, so some files went unchecked: pass Reader the process_group "
                "you pass dcp.load"
            )
        return self._inner.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._inner is not None  # set up by now
        return self._inner.read_data(plan, planner)
