"""``Writer``: a shardline checkpoint from code that calls ``torch.distributed.checkpoint.save`` itself.

``dcp.save(state, storage_writer=Writer("ckpts/step-100"))`` (or ``dcp.async_save``) writes the same
checkpoint ``shardline.checkpoint.save`` writes: every file hashed while written, ``manifest.json``,
``manifest.sha256``, ``SHA256SUMS``, the provenance statement, an atomic commit, and a ledger row.

Note: how the save protocol (``save.py``) maps onto DCP's calls, with no collective of its own
(DCP's plan and write steps carry everything, and DCP reports any rank's error on every rank).

1. **Preflight**: the coordinator's ``prepare_global_plan`` -- it has every rank's plan and runs
   before any data is written -- clears what crashed saves left beside the target
   (:meth:`.CheckpointStore.open_directory`), reserves the target through its store (on disk the
   hidden ``.step-N.tmp-<hex>`` directory) and puts its name in every rank's plan, which DCP
   scatters. A taken target or a broken ledger fails the plan step on every rank.
2. **Write**: each rank's ``write_data`` checks it can write there, then writes and hashes its
   files through :class:`~.hashing_writer.HashingWriter`; the digests ride to the coordinator in
   the write results DCP gathers.
3. **Manifest, commit, ledger row**: the coordinator's ``finish`` (only called once every rank
   wrote) writes ``.metadata``, then commits through :func:`~.save.commit_written` -- the same
   function ``save`` commits with -- and appends the commit row (:mod:`.records`). An error there
   reaches every rank as DCP's ``CheckpointException``.

A write that fails on any rank never reaches ``finish``: nothing is committed, and the in-progress
directory is removed when the coordinator's writer is garbage collected -- at the latest by the next
``Writer`` save in that process, which collects garbage first while one is unfinished -- or, after a
crash, by the next save beside it (step 1).
A framework that keeps a small file of its own beside DCP's (Lightning's ``meta.pt``) passes it as
``extra_files``: the coordinator writes each one into the in-progress directory in ``finish``, its
SHA-256 taken from the bytes it writes, so it is listed, hashed and committed with the rest.
The manifest records the tensors' layout as the state dict shows it (``sharding``,
:func:`~shardline.checkpoint.state.layout.describe_state_sharding`), since the engine's units are unknown.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from shardline.checkpoint.coordination.parallelism import AUTO, resolve_files_per_rank
from shardline.checkpoint.format.canonical import config_hash, sha256_hex
from shardline.checkpoint.format.dcp_io import key_paths
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.hashing_writer import HashingWriter
from shardline.checkpoint.integrity.manifest import DCP_METADATA, DERIVED_FILES
from shardline.checkpoint.integrity.packed_plan import PLAN_DIGEST_KEY
from shardline.checkpoint.integrity.verify import check_expected_hash
from shardline.checkpoint.lifecycle.capture import TAG_PATTERN, CapturedCheckpoint
from shardline.checkpoint.lifecycle.recovery import run_name
from shardline.checkpoint.lifecycle.save import CheckpointInfo, commit_written, committed_info
from shardline.checkpoint.provenance.directory import step_of
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.provenance.records import record_commit
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.checkpoint.provenance.statement import STATEMENT_FILE
from shardline.checkpoint.state.layout import describe_state_sharding
from shardline.checkpoint.storage.key_prefixes import SHARDS_FOLDER
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import local_path, locate, store_for
from shardline.errors import CheckpointError, ConfigurationError, LineageError, PublishError

__all__ = ["Writer"]

_EXTRA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DCP_DATA_NAME = re.compile(r"^__\d+_\d+\.distcp$")
_RESERVED = frozenset({DCP_METADATA, STATEMENT_FILE, *DERIVED_FILES, SHARDS_FOLDER})  # shards/: a bucket's data


def _check_extra_files(extra: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """``extra_files``, checked: plain file names that no checkpoint file of DCP's or shardline's has, bytes values."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ConfigurationError(f"extra_files must map file names to bytes, got {type(extra).__name__}")
    for name, data in extra.items():
        if not isinstance(name, str) or not _EXTRA_NAME.match(name):
            raise ConfigurationError(
                f"extra_files name {name!r} is not a plain file name: use letters, digits, '.', '_' and '-', not "
                "starting with '.' (the checkpoint directory is flat)"
            )
        if name in _RESERVED or _DCP_DATA_NAME.match(name):
            raise ConfigurationError(
                f"extra_files name {name!r} is a name the checkpoint's own files use ({', '.join(sorted(_RESERVED))}, "
                "__R_N.distcp); rename the file"
            )
        if not isinstance(data, bytes):
            raise ConfigurationError(f"extra_files[{name!r}] must be bytes, got {type(data).__name__}")
    return dict(extra)


@dataclasses.dataclass(frozen=True)
class _Assignment:
    """What the coordinator's global plan tells a rank: its files' prefix (DCP's) and where the save writes."""

    prefix: Any
    in_progress: str


_unfinished: weakref.WeakSet[Writer] = weakref.WeakSet()
"""This process's writers that planned a save and did not finish it (in flight, or failed on some rank)."""


def _abandon(in_progress: Location) -> None:
    """A save that never reached ``finish`` (a rank failed): remove what it wrote and give up its lock."""
    store_for(in_progress).discard(in_progress)


class Writer(StorageWriter):
    """A ``torch.distributed.checkpoint`` ``StorageWriter`` whose save is a committed, hashed shardline checkpoint.

    Pass one to ``dcp.save(state, storage_writer=Writer(path))`` or ``dcp.async_save(...)`` (its default thread
    executor) on every rank. ``path`` must not exist; nothing is there unless the save committed. Load the
    result with :class:`Reader` (or ``shardline.checkpoint.load``, ``shardline verify``).

    Args:
        path: The checkpoint directory to create (``run/checkpoints/step-100``), or an object-store URL.
        step: The training step the manifest records (default: parsed from a ``step-N`` directory name).
        tag: Recorded in the manifest (``[a-z0-9_]+``).
        parent_manifest_hash: The checkpoint this state descends from (e.g. the one a :class:`Reader` loaded:
            its ``manifest_hash``); default: the newest checkpoint the ledger records (none for the first).
        ledger_path: The lineage ledger to record the commit in (default: ``lineage.sqlite`` beside the
            checkpoint, where a ``CheckpointManager`` on that directory and ``shardline lineage`` look for it;
            required, and local, for a URL ``path``).
        config: The training config (plain JSON data): its hash goes in the manifest, itself in the statement.
        data_fingerprint: A string identifying the training data, recorded in the manifest.
        files_per_rank: Files each rank writes (0: automatic).
        storage_options: Options of the fsspec file system of a URL ``path``.
        extra_files: Small files to store beside DCP's, ``{name: bytes}`` (a framework's own metadata file,
            such as Lightning's ``meta.pt``); read on the coordinator only, written, hashed and committed
            with the checkpoint.
        run_tags: ``{key: value}`` strings the run is filed under (ticket, owner...), recorded in the manifest.

    After the save, :attr:`info` holds the committed checkpoint on the coordinator (rank 0; None elsewhere).

    Raises:
        ConfigurationError: no step (none given and the name is not ``step-N``), a bad tag, hash or config,
            a URL without ``ledger_path``, or an ``extra_files`` name that is not a plain file name or is one the
            checkpoint's own files use.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        step: int | None = None,
        tag: str | None = None,
        parent_manifest_hash: str | None = None,
        ledger_path: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
        data_fingerprint: str | None = None,
        files_per_rank: int = AUTO,
        storage_options: Mapping[str, Any] | None = None,
        extra_files: Mapping[str, bytes] | None = None,
        run_tags: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self._run_tags = check_run_tags(run_tags, where="run_tags")
        resolve_files_per_rank(files_per_rank)
        self._extra_files = _check_extra_files(extra_files)
        if tag is not None and (not isinstance(tag, str) or not TAG_PATTERN.match(tag)):
            raise ConfigurationError(f"checkpoint tag must match [a-z0-9_]+, got {tag!r}")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ConfigurationError(f"step must be a non-negative int, got {step!r}")
        if data_fingerprint is not None and not isinstance(data_fingerprint, str):
            raise ConfigurationError(
                f"data_fingerprint must be a string or None, got {type(data_fingerprint).__name__}"
            )
        self._config_sha256 = config_hash(config) if config is not None else None  # validates: JSON data only
        self._config = config
        self._step = step
        self._tag = tag
        self._parent = check_expected_hash(parent_manifest_hash, where="parent_manifest_hash")
        self._ledger_path = ledger_path
        self._fingerprint = data_fingerprint
        self._files_per_rank = files_per_rank
        self._storage_options = storage_options
        self.info: CheckpointInfo | None = None
        self.reset(path)

    # ------------------------------------------------------------------ set-up (every rank)
    def reset(self, checkpoint_id: str | os.PathLike[str] | Location | None = None) -> None:
        """A new save (DCP calls this when ``checkpoint_id`` is passed with the writer): its target and step."""
        if checkpoint_id is not None:
            self._final = locate(checkpoint_id, storage_options=self._storage_options).absolute()
            step = self._step if self._step is not None else step_of(self._final.name)
            if step is None:
                raise ConfigurationError(
                    f"no step for checkpoint {self._final}: pass step= to shardline.checkpoint.Writer, or name the "
                    "directory step-N (e.g. checkpoints/step-100)"
                )
            self._save_step = step
            if self._ledger_path is not None:
                ledger = local_path(self._ledger_path)
            else:
                directory = local_path(self._final.parent)
                ledger = directory / LEDGER_NAME if directory is not None else None
            if ledger is None:
                raise ConfigurationError(
                    f"checkpoint {self._final} is in an object store: pass ledger_path= (a local file) for its "
                    "lineage ledger"
                )
            self._ledger_file: Path = ledger.absolute()
        self._inner: HashingWriter | None = None
        self._in_progress: Location | None = None
        self._abandon: weakref.finalize[Any, Writer] | None = None
        self._sharding: dict[str, Any] | None = None
        self._coordinator = False
        self._rank = 0

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint this writer creates (DCP's logging names it)."""
        return str(self._final)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP on its own: a user passes it on purpose

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self._final))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigurationError(
                "shardline.checkpoint.Writer commits once for all ranks, so it needs DCP's collectives; call "
                "dcp.save without use_collectives=False"
            )
        self._coordinator = is_coordinator
        self._rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    # ------------------------------------------------------------------ preflight (coordinator)
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if any(PLAN_DIGEST_KEY in (p.planner_data or {}) for p in plans):
            raise ConfigurationError(
                "the DCP-native Writer saves the per_tensor layout (its manifest describes the state dict as DCP "
                "stores it); for layout='packed' save with shardline.checkpoint.save or a CheckpointManager"
            )
        if _unfinished:
            # Note: DCP gives a writer no call when a save fails on another rank. A failed save's writer is
            # garbage (in a reference cycle with DCP's exception): collecting it runs its finalizer, which removes
            # its in-progress directory and releases the lock; a save still in flight is referenced, so it stays.
            gc.collect()
        ledger = self._ledger()
        store = store_for(self._final)
        store.open_directory(self._final.parent)
        rows = ledger.rows() if ledger.path.is_file() else []
        name, _ = store.prepare(self._final, run=lambda: run_name(ledger, rows))
        self._in_progress = self._final.with_name(name)
        self._abandon = weakref.finalize(self, _abandon, self._in_progress)
        _unfinished.add(self)
        self._inner = self._hashing_writer(self._in_progress)
        plans = self._inner.prepare_global_plan(plans)  # each rank's file prefix
        return [dataclasses.replace(p, storage_data=_Assignment(p.storage_data, name)) for p in plans]

    def _ledger(self) -> Ledger:
        """The ledger (its chain checked; a broken one refuses the save before anything is written); the parent
        defaults to its newest commit."""
        ledger = Ledger(self._ledger_file, storage_options=self._storage_options)
        if ledger.path.is_file():
            problems = ledger.verify(check_checkpoints=False).problems
            if problems:
                raise LineageError(
                    f"the lineage ledger {ledger.path} does not verify: {problems[0]}; refusing to append checkpoint "
                    f"{self._final} to a broken chain. Restore the ledger from a backup, or run `shardline lineage "
                    f"{ledger.path} --new-chain` to start a new chain."
                )
            if self._parent is None:
                commits = [r for r in ledger.rows() if r.is_commit]
                self._parent = commits[-1].manifest_sha256 if commits else None
        return ledger

    def _hashing_writer(self, in_progress: Location) -> HashingWriter:
        inner = HashingWriter(in_progress, final_path=self._final, files_per_rank=self._files_per_rank, sync_later=True)
        inner.set_up_storage_writer(self._coordinator, rank=self._rank)
        return inner

    # ------------------------------------------------------------------ write (every rank)
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assigned = plan.storage_data
        if not isinstance(assigned, _Assignment):
            raise CheckpointError(
                f"rank {self._rank}'s save plan for {self._final} names no directory to write: the planner or "
                "another writer replaced what shardline.checkpoint.Writer planned; nothing was committed"
            )
        in_progress = self._final.with_name(assigned.in_progress)
        store_for(in_progress).check_writable(in_progress, prepared_here=self._coordinator)
        if self._inner is None:
            self._inner = self._hashing_writer(in_progress)
        if self._coordinator:
            state = getattr(planner, "state_dict", None)
            self._sharding = describe_state_sharding(state if isinstance(state, Mapping) else {})
        return self._inner.write_data(dataclasses.replace(plan, storage_data=assigned.prefix), planner)

    # ------------------------------------------------------------------ manifest, commit, ledger (coordinator)
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self._inner is not None  # planned and written by now
        assert self._in_progress is not None
        in_progress, store = self._in_progress, store_for(self._in_progress)
        try:
            try:
                self._inner.finish(metadata, results)  # .metadata, and every file's digest
                digests = sorted([*(self._inner.file_digests or []), *self._write_extra_files(in_progress)])
                captured = self._captured(metadata, world_size=len(results))
            except Exception:
                store.discard(in_progress)
                raise
            ledger = Ledger(self._ledger_file, storage_options=self._storage_options)

            def record(info: CheckpointInfo) -> None:
                record_commit(ledger, info, recovered=False)

            outcome = commit_written(
                captured,
                in_progress,
                digests,
                after_commit=record,
                wait_synced=self._inner.wait_synced,
            )
        finally:
            store.end_save(in_progress)
            _unfinished.discard(self)
            if self._abandon is not None:
                self._abandon.detach()
        try:
            self.info = committed_info(captured, outcome)
        except PublishError as e:
            self.info = e.info if isinstance(e.info, CheckpointInfo) else None
            raise

    def _write_extra_files(self, in_progress: Location) -> list[FileDigest]:
        """``extra_files`` written into the in-progress directory (flushed where the store flushes files), with the
        digests of the bytes written."""
        files = store_for(in_progress).save_files(in_progress)
        digests = []
        for name, data in sorted(self._extra_files.items()):
            target = str(files.join(files.root, name))
            with files.open_write(target) as stream:
                stream.write(data)
                stream.flush()
                if files.fsync:
                    os.fsync(stream.fileno())
            files.written(target)
            digests.append(FileDigest(path=name, rank=self._rank, bytes=len(data), sha256=sha256_hex(data)))
        return digests

    def _captured(self, metadata: Metadata, *, world_size: int) -> CapturedCheckpoint:
        """What the manifest records, from DCP's metadata and this writer's arguments."""
        tops = sorted({str(p[0]) for p in key_paths(metadata).values()})
        tensors = [md for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
        return CapturedCheckpoint(
            final=self._final,
            step=self._save_step,
            tag=self._tag,
            kind="sharded",
            world_size=world_size,
            state_dict={},
            units=[],
            model_info={"source": "torch.distributed.checkpoint", "top_level_keys": tops, "tensors": len(tensors)},
            contents={
                "model": "model" in tops,
                "optimizer": "optimizer" in tops or "optim" in tops,
                "trainer_state": False,
                "per_rank_state": False,
                "config": False,
            },
            config_sha256=self._config_sha256,
            data_fingerprint=self._fingerprint,
            parent_manifest_hash=self._parent,
            config=self._config,
            sharding=self._sharding or {},
            run_tags=self._run_tags,
        )

    def __reduce__(self) -> NoReturn:
        # Note: DCP's process-based async executor pickles the writer into a checkpoint process. The commit
        # holds this process's lock on the in-progress directory and reports to this writer, so refuse it.
        raise ConfigurationError(
            "shardline.checkpoint.Writer commits in the process that plans the save, so it cannot be sent to "
            "another process: use dcp.async_save's default thread executor "
            "(async_checkpointer_type=AsyncCheckpointerType.THREAD)"
        )
