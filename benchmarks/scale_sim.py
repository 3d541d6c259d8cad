"""Simulator: shardline's checkpoint protocol at W ranks, run in one process with shardline's own code.

What each rank's transport would carry is built as the objects DCP gathers or scatters (no
process group, no data written): each rank's data files are replaced by their sizes and stand-in
digests, and the state dict is a 70B Llama's tensors (names and shapes from the published config:
80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads, vocab 128256; fp32 weights and
two Adam moments) sharded FULL_SHARD (``benchmarks/scale_layout.py``). Per W it runs and times:

* **Commit (rank 0)**: ``hashing_writer.split_digests`` over every rank's gathered write results
  (the digest records of ``files`` files per rank), then the save's ``_records`` (provenance
  statement, ``build_manifest``, canonical JSON, SHA-256) and ``render_sums``; each piece is also
  timed on its own. ``bytes gathered`` is the pickled size of every rank's write results (DCP's
  ``gather_object``): the digest records plus DCP's own per-item results.
* **DCP planning**: torch's ``DefaultSavePlanner.create_global_plan`` over W local plans of
  ``WriteItem`` chunks, and ``.metadata`` as ``FileSystemWriter.finish`` pickles it. The plan's
  validation is timed twice: torch's ``_validate_global_plan`` (quadratic for some tensors, run up
  to ``--validate-max-world``) and shardline's save planner's (``plan_validation.py``, every W).
* **Load planning**: every rank's check and unpickling of ``.metadata`` (``opening.py``: SHA-256, then
  ``dcp_io.unpickle_metadata``), one rank's read plan against that metadata twice -- torch's
  resharding planner (``create_read_items_for_chunk_list``, what every rank ran before) and
  shardline's ``ShardlineLoadPlanner`` (each piece found by its offsets and sizes; the same items,
  checked) -- and rank 0's global plan in shardline's ``VerifyingReader.prepare_global_plan``
  (which rank hashes which file).
* **Resume selection**: ``resume.find_candidates`` over a directory of ``--keep`` committed
  checkpoints of W ranks and a 1,000-row ledger.
* **Beside those** (``benchmarks/scale_side_costs.py``): rank 0's listing check before the commit (a real
  directory of W x ``files`` empty files), the whole checked manifest (its bytes, rank 0's encoding, each
  rank's decoding), what of it each rank receives at a load, and the elastic restart's restart count.
* **Packed layout** (``--layout packed``, ``benchmarks/scale_packed.py``): the save planner's packed
  code at W -- rank 0's table build, a rank's local plan, rank 0's global plan with metadata and
  plan check, ``.metadata``'s items and pickled size -- printed beside the per-tensor figures.
* **Object store**: the requests a save and a verified load make under the checkpoint's prefixes,
  counted from the store's operations (claim, multipart uploads in s3fs's 50 MiB parts, records; computed,
  not sent), and the floor they put on the save at S3's documented 3,500 PUT/s and 5,500 GET/s per prefix:
  the data files under ``shards/GGGG/`` as a bucket save spreads them (256 ranks a prefix,
  ``key_prefixes.py``), so the fullest prefix sets the floor (the data files' names elsewhere are the
  flat ones of a local save).

Note: the DCP pieces scale with the number of tensors times W (35M chunks at W=16,384), more than
one process here can hold, so they run on ``--dcp-layers`` decoder layers (default 1: with the
embedding, final norm and head, 36 of the 2,169 tensors) and are scaled to all tensors by their
count (each tensor's planning is independent of the others'); columns so scaled are marked in the
table. Everything shardline gathers or writes per file runs at full size.
The ledger over many saves is ``benchmarks/scale_ledger.py``.

    python -m benchmarks.scale_sim [--worlds 8,64,512,1024,4096,16384] [--files 8] [--json out.json]
        [--plot docs/benchmarks/scale.png] [--layout packed]
    python -m benchmarks.scale_sim --from-json out.json --plot docs/benchmarks/scale.png   # redraw only
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.scale_layout import (
    LLAMA_70B,
    Tensor,
    fake_sha256,
    file_bytes,
    llama_tensors,
    rank_rows,
    state_dict_keys,
)
from benchmarks.scale_packed import PACKED_COLUMNS, packed_costs
from benchmarks.scale_side_costs import side_costs
from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.format.dcp_io import unpickle_metadata
from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.hashing_writer import digest_result, split_digests
from shardline.checkpoint.integrity.manifest import DCP_METADATA, MANIFEST_HASH_FILE, build_manifest
from shardline.checkpoint.integrity.plan_validation import validate_global_plan
from shardline.checkpoint.integrity.reading import VerifyingReader
from shardline.checkpoint.lifecycle import commit_records
from shardline.checkpoint.lifecycle.capture import CapturedCheckpoint
from shardline.checkpoint.lifecycle.resume import find_candidates
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.storage.key_prefixes import rank_of, spread_prefix
from shardline.checkpoint.storage.stores import locate

__all__ = ["WORLDS", "SimulatedSave", "main", "simulate"]

WORLDS = (8, 64, 512, 1024, 4096, 16384)
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


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """``(median CPU seconds of reps calls, the last result)``.

    Note: CPU time of this process (``time.process_time``), not wall time: every piece timed here runs on one
    thread and reads only what is in memory or the page cache, so on an idle core the two are equal, and on a
    machine other jobs share (this one's CI and its neighbours) the CPU time does not count their share.
    """
    times, out = [], None
    gc.disable()  # as timeit does: a collection the live objects of W simulated ranks trigger is not the code's cost
    try:
        for _ in range(reps):
            t = time.process_time()
            out = fn()
            times.append(time.process_time() - t)
    finally:
        gc.enable()
    return statistics.median(times), out


def _units(world: int, layers: int) -> list[dict[str, Any]]:
    """``describe_units`` records of a FULL_SHARD Llama: one unit per decoder layer, then the root."""
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None, "buffer_dtype": None,
          "cast_forward_inputs": True}  # fmt: skip
    unit = {"strategy": "full_shard", "shard_size": world, "replicate_size": 1, "master_dtype": "float32",
            "mixed_precision": mp}  # fmt: skip
    params = llama_tensors(layers=layers)
    numel = {name: math.prod(shape) for name, shape in params}
    out = []
    for i in range(layers):
        mine = [n for n in numel if n.startswith(f"model.layers.{i}.")]
        out.append({**unit, "name": f"model.layers.{i}", "params": len(mine), "numel": sum(numel[n] for n in mine)})
    rest = [n for n in numel if not n.startswith("model.layers.")]
    return [*out, {**unit, "name": "", "params": len(rest), "numel": sum(numel[n] for n in rest)}]


def _model_info(tensors: list[Tensor]) -> dict[str, Any]:
    state = {t.key.removeprefix("model."): [list(t.shape), "float32"] for t in tensors if t.key.startswith("model.")}
    return {"parameters": sum(math.prod(s[0]) for s in state.values()), "scalars": [], "state": state,
            "tensors": len(state), "tied": []}  # fmt: skip


def captured_checkpoint(final: Path, world: int, tensors: list[Tensor], layers: int) -> CapturedCheckpoint:
    """What a save's capture hands the commit (the state dict itself is not needed there)."""
    return CapturedCheckpoint(
        final=locate(final),
        step=100_000,
        tag=None,
        kind="sharded",
        world_size=world,
        state_dict={},
        units=_units(world, layers),
        model_info=_model_info(tensors),
        contents={"model": True, "optimizer": True, "trainer_state": True, "config": True, "per_rank_state": True},
        config_sha256=fake_sha256("config"),
        data_fingerprint="simulated",
        parent_manifest_hash=fake_sha256("parent"),
        config={"model": "llama-3-70b", "world_size": world},
    )


def rank_digests(tensors: list[Tensor], world: int, rank: int, files: int) -> list[FileDigest]:
    """The digests rank ``rank`` reports for its ``files`` data files."""
    sizes = file_bytes(tensors, world, rank, files)
    return [
        FileDigest(path=f"__{rank}_{n}.distcp", rank=rank, bytes=size, sha256=fake_sha256(f"{rank}/{n}"))
        for n, size in enumerate(sizes)
    ]


class Piece(torch.Tensor):
    """A rank's piece of a tensor as DCP's load planners see one (its global size and, as a DTensor answers
    ``__create_chunk_list__``, its box), holding no data."""

    shape_: torch.Size
    box: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], box: ChunkStorageMetadata) -> Piece:
        piece = torch.Tensor._make_subclass(cls, torch.empty(0))
        piece.shape_, piece.box = torch.Size(shape), box
        return piece

    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        return self.shape_ if dim is None else self.shape_[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.box]


def _chunk(t: Tensor, world: int, rank: int) -> ChunkStorageMetadata:
    start, rows = rank_rows(t.shape[0], world, rank)
    offsets = torch.Size([start, *([0] * (len(t.shape) - 1))])
    return ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *t.shape[1:]]))


def local_save_plan(tensors: list[Tensor], world: int, rank: int) -> SavePlan:
    """Rank ``rank``'s DCP save plan: one SHARD item per tensor (its DTensor piece), as DCP's planner builds it."""
    items = []
    props = TensorProperties(dtype=torch.float32)
    for t in tensors:
        chunk = _chunk(t, world, rank)
        data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size(t.shape))
        items.append(WriteItem(index=MetadataIndex(t.key, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data))
    return SavePlan(items, planner_data={})


def _item_results(plan: SavePlan, rank: int, files: int, t: Tensor | None = None) -> list[WriteResult]:
    """DCP's write results of a rank's plan: each item in one of its files, as ``FileSystemWriter`` reports them."""
    out = []
    offset = [0] * files
    for n, item in enumerate(plan.items):
        assert item.tensor_data is not None
        length = math.prod(item.tensor_data.chunk.sizes) * 4
        k = n % files
        info = _StorageInfo(relative_path=f"__{rank}_{k}.distcp", offset=offset[k], length=length)
        offset[k] += length
        out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    return out


@dataclasses.dataclass
class SimulatedSave:
    """One W's measurements (seconds, bytes, counts); ``scaled`` names the fields scaled from sampled tensors."""

    world: int
    files: int
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    scaled: list[str] = dataclasses.field(default_factory=list)
    extrapolated: list[str] = dataclasses.field(default_factory=list)


def _object_store(
    digests: list[FileDigest], records: dict[str, int], world: int, *, spread: bool = True
) -> dict[str, float]:
    """Requests a save and a verified load make under the checkpoint's prefixes (see the module note).

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


def simulate(
    world: int,
    *,
    files: int = 8,
    layers: int = LLAMA_70B.layers,
    dcp_layers: int = 1,
    keep: int = 3,
    reps: int | None = None,
    workdir: Path | None = None,
    validate_max_world: int = 4096,
    layout: str = "per_tensor",
) -> SimulatedSave:
    """Run the protocol's rank-0 and per-rank planning code for ``world`` ranks (see the module note).

    ``layout="packed"`` also runs the packed layout's planning (``scale_packed.py``).

    torch's validation of the global save plan is quadratic in W for some tensors; above
    ``validate_max_world`` it is not run (:func:`extrapolate` fills it in from the largest W measured).
    """
    reps = reps if reps is not None else (3 if world <= 1024 else 1)
    tensors = state_dict_keys(layers=layers)
    sample = state_dict_keys(layers=dcp_layers)
    scale = len(tensors) / len(sample)
    out = SimulatedSave(world=world, files=files)
    v = out.values
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        final = root / "checkpoints" / "step-100000"
        captured = captured_checkpoint(final, world, tensors, layers)

        # --- DCP planning over the sampled tensors (scaled to all of them)
        plans = [local_save_plan(sample, world, r) for r in range(world)]
        planner = DefaultSavePlanner(flatten_state_dict=False)
        # DefaultSavePlanner._create_global_plan, in its two parts: the plan and metadata, then their validation
        t, (global_plan, metadata) = timed(lambda: create_default_global_save_plan(planner._dedup_save_plans(plans)), 1)
        v["dcp_global_plan_s"] = t * scale
        # shardline's save planner validates along the split dimension (plan_validation.py): every W
        t, errors = timed(lambda: validate_global_plan(global_plan, metadata), 1)
        assert not errors, errors[:3]
        v["shardline_validate_s"] = t * scale
        if world <= validate_max_world:
            t, errors = timed(lambda: _validate_global_plan(global_plan, metadata), 1)
            assert not errors, errors[:3]
            v["dcp_validate_s"] = t * scale
        else:
            out.extrapolated.append("dcp_validate_s")
        item_results = [_item_results(p, r, files) for r, p in enumerate(global_plan)]
        if layout == "packed":
            v.update(packed_costs(world, tensors, timed=timed, reps=reps, files=files))

        def finish() -> tuple[Metadata, bytes]:  # FileSystemWriter.finish: every result's storage data, pickled
            storage: dict[MetadataIndex, Any] = {}
            for results in item_results:
                storage.update({wr.index: wr.storage_data for wr in results})
            md = dataclasses.replace(metadata, storage_data=storage)
            return md, pickle.dumps(md)

        t, (full_md, metadata_pickle) = timed(finish, 1)
        v["dcp_finish_s"] = t * scale
        v["dcp_metadata_bytes"] = len(metadata_pickle) * scale
        # every rank, opening the checkpoint: .metadata hashed against the manifest, then unpickled (opening.py)
        t_hash, _ = timed(lambda: sha256_hex(metadata_pickle), reps)
        t_load, _ = timed(lambda: unpickle_metadata(metadata_pickle, DCP_METADATA), 1)
        v["metadata_open_per_rank_s"] = (t_hash + t_load) * scale
        dcp_gathered = sum(len(pickle.dumps(r)) for r in item_results) * scale

        # --- what rank 0 gathers, and its commit work on it
        digests = [d for r in range(world) for d in rank_digests(tensors, world, r, files)]
        metadata_digest = FileDigest(DCP_METADATA, 0, int(v["dcp_metadata_bytes"]), fake_sha256(DCP_METADATA))
        per_rank = [[digest_result(d) for d in digests[r * files : (r + 1) * files]] for r in range(world)]
        v["gathered_bytes"] = sum(len(pickle.dumps(r)) for r in per_rank) + dcp_gathered
        t_split, (_, by_name) = timed(lambda: split_digests(per_rank), reps)
        gathered = [*by_name.values(), metadata_digest]
        # the manifest, the statement naming it and SHA256SUMS, each encoded once (commit_records.py)
        t_records, records = timed(lambda: commit_records.build_records(captured, gathered), reps)
        statement, listed, manifest_bytes, manifest_digest, sums = (records.statement, records.files,
            records.manifest, records.manifest_sha256, records.sums)  # fmt: skip
        t_sha, _ = timed(lambda: sha256_hex(manifest_bytes), reps)
        v["commit_rank0_s"] = t_split + t_records
        fields = {k: getattr(captured, k) for k in ("step", "tag", "kind", "world_size", "units", "config_sha256")}
        build = {"model_info": captured.model_info, "contents": captured.contents, "files": gathered,
                 "data_fingerprint": "simulated", "parent_manifest_sha256": captured.parent_manifest_hash}  # fmt: skip
        v["build_manifest_s"], manifest = timed(lambda: build_manifest(**fields, **build), reps)
        v["canonical_json_s"], _ = timed(lambda: canonical_json(manifest), reps)
        v["manifest_sha256_s"] = t_sha
        v["manifest_bytes"] = len(manifest_bytes)
        v["statement_bytes"] = len(statement)
        v["sums_bytes"] = len(sums)

        # --- load planning: one rank's resharding plan, rank 0's global plan (who hashes which file)
        mid = world // 2

        def rank_plan(rank: int) -> list[ReadItem]:
            md = full_md.state_dict_metadata
            items = []
            for t in sample:
                saved = md[t.key]
                assert isinstance(saved, TensorStorageMetadata)
                items += create_read_items_for_chunk_list(t.key, saved, [_chunk(t, world, rank)])
            return items

        t, torch_items = timed(lambda: rank_plan(mid), reps)
        v["load_plan_per_rank_s"] = t * scale

        def fast_plan(rank: int, rounds: int) -> list[ReadItem]:  # shardline's planner, as a load runs it
            state = {t.key: Piece(t.shape, _chunk(t, world, rank)) for t in sample}
            for _ in range(rounds):
                planner = ShardlineLoadPlanner(rank=rank)
                planner.set_up_planner(state, full_md)
                items = planner.create_local_plan().items
            return items

        assert fast_plan(mid, 1) == torch_items  # the same read items as torch's planner
        rounds = 20  # a few milliseconds at any W: repeated, so the CPU clock's resolution does not decide it
        t, _ = timed(lambda: fast_plan(mid, rounds), reps)
        v["load_plan_fast_per_rank_s"] = t / rounds * scale
        reader = VerifyingReader(root, full_md, to_hash=[d.to_json() for d in listed if d.path.endswith(".distcp")])
        reader.set_up_storage_reader(full_md, is_coordinator=True)
        load_plans = []
        for results in item_results:  # same world and layout: each rank reads back its own items
            items = [
                ReadItem(LoadItemType.TENSOR, wr.index, torch.Size([0]), wr.index, torch.Size([0]), torch.Size([1]))
                for wr in results
            ]
            load_plans.append(reader.prepare_local_plan(LoadPlan(items)))  # each rank's own step, in parallel
        v["load_global_plan_s"], global_plans = timed(lambda: reader.prepare_global_plan(load_plans), reps)
        share_bytes = max(len(pickle.dumps(p.storage_data)) for p in global_plans)  # entries each rank hashes

        # --- resume selection over `keep` committed checkpoints of this W
        for n in range(keep):
            d = root / "checkpoints" / f"step-{(n + 1) * 1000}"
            d.mkdir(parents=True)
            (d / "manifest.json").write_bytes(manifest_bytes)
            (d / MANIFEST_HASH_FILE).write_text(f"{manifest_digest}  manifest.json\n")
        ledger = Ledger(root / "lineage.sqlite")
        directory = locate(root / "checkpoints")
        v["resume_select_s"], found = timed(lambda: find_candidates("auto", directory=directory, ledger=ledger), 1)
        assert len(found.committed) == keep, found

        # --- rank 0's listing check, the checked manifest's broadcast at load, the restart gather (side_costs.py)
        v.update(side_costs(root, [*digests, metadata_digest], manifest_bytes, manifest_digest,
                            share_bytes=share_bytes, timed=timed, reps=reps))  # fmt: skip

        records_sizes = {"provenance.intoto.json": len(statement), "manifest.json": len(manifest_bytes),
                         MANIFEST_HASH_FILE: 81, "SHA256SUMS": len(sums)}  # fmt: skip
        v.update(_object_store([*digests, metadata_digest], records_sizes, world))
    out.scaled = [
        "dcp_global_plan_s",
        "dcp_validate_s",
        "shardline_validate_s",
        "dcp_finish_s",
        "dcp_metadata_bytes",
        "gathered_bytes",
        "load_plan_per_rank_s",
        "load_plan_fast_per_rank_s",
    ]
    return out


SAVE_COLUMNS = [
    ("world", "W", "{:,.0f}"),
    ("commit_rank0_s", "rank-0 commit (s)", "{:.3f}"),
    ("listing_check_s", "rank-0 listing check (s)", "{:.3f}"),
    ("build_manifest_s", "build manifest (s)", "{:.3f}"),
    ("canonical_json_s", "canonical JSON (s)", "{:.3f}"),
    ("manifest_sha256_s", "manifest SHA-256 (s)", "{:.4f}"),
    ("manifest_bytes", "manifest", "bytes"),
    ("statement_bytes", "statement", "bytes"),
    ("gathered_bytes", "gathered to rank 0 *", "bytes"),
    ("dcp_global_plan_s", "DCP global plan (s) *", "{:.1f}"),
    ("dcp_validate_s", "DCP plan validation (s) *", "{:.0f}"),
    ("shardline_validate_s", "shardline plan validation (s) *", "{:.2f}"),
    ("dcp_finish_s", "DCP finish (s) *", "{:.1f}"),
    ("dcp_metadata_bytes", ".metadata *", "bytes"),
]
LOAD_COLUMNS = [
    ("world", "W", "{:,.0f}"),
    ("metadata_open_per_rank_s", "open .metadata per rank (s) *", "{:.2f}"),
    ("load_plan_per_rank_s", "load plan per rank, torch's planner (s) *", "{:.2f}"),
    ("load_plan_fast_per_rank_s", "load plan per rank, shardline's (s) *", "{:.3f}"),
    ("load_global_plan_s", "rank-0 load global plan (s)", "{:.3f}"),
    ("resume_select_s", "resume selection (s)", "{:.3f}"),
    ("manifest_broadcast_bytes", "checked manifest, whole", "bytes"),
    ("manifest_broadcast_rank0_s", "its encoding, rank 0 (s)", "{:.3f}"),
    ("manifest_receive_per_rank_s", "its decoding, per rank (s)", "{:.3f}"),
    ("manifest_load_bytes_per_rank", "manifest to each rank at a load", "bytes"),
    ("restart_count_bytes_per_rank", "restart count to each rank", "bytes"),
    ("objects_per_prefix", "objects per prefix (max)", "{:,.0f}"),
    ("save_requests", "save requests", "{:,.0f}"),
    ("save_requests_per_prefix", "save requests per prefix (max)", "{:,.0f}"),
    ("save_floor_s", "save floor at 3,500/s per prefix (s)", "{:.1f}"),
    ("load_requests", "load requests", "{:,.0f}"),
    ("load_requests_per_prefix", "load requests per prefix (max)", "{:,.0f}"),
    ("load_floor_s", "load floor at 5,500/s per prefix (s)", "{:.1f}"),
]
COLUMNS = SAVE_COLUMNS + LOAD_COLUMNS[1:]


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def extrapolate(rows: list[SimulatedSave]) -> None:
    """Fill each row's ``extrapolated`` fields from the two largest W that measured them (their log-log slope)."""
    for row in rows:
        for key in row.extrapolated:
            have = [r for r in rows if key in r.values and r.world < row.world]
            if len(have) < 2:
                row.values[key] = float("nan")
                continue
            a, b = have[-2], have[-1]
            slope = math.log(b.values[key] / a.values[key]) / math.log(b.world / a.world)
            row.values[key] = b.values[key] * (row.world / b.world) ** slope


def markdown(rows: list[SimulatedSave], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    """A table of ``columns`` (one row per W); ``~``: extrapolated."""
    head = "| " + " | ".join(c[1] for c in columns) + " |"
    lines = [head, "|" + "---:|" * len(columns)]
    for r in rows:
        vals = {"world": r.world, **r.values}
        cells = []
        for key, _, form in columns:
            value = vals.get(key, math.nan)
            cells.append(
                ("~" if key in r.extrapolated else "") + (human(value) if form == "bytes" else form.format(value))
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exponents(rows: list[SimulatedSave]) -> dict[str, float]:
    """Each cost's log-log slope between the smallest and the largest W measured."""
    lo, hi = rows[0], rows[-1]
    out = {}
    for key, a in lo.values.items():
        if key in hi.extrapolated or key in lo.extrapolated:
            continue
        b = hi.values[key]
        if a > 0 and b > 0:
            out[key] = math.log(b / a) / math.log(hi.world / lo.world)
    return out


PLOT_SECONDS = [
    ("commit_rank0_s", "rank-0 commit"),
    ("manifest_sha256_s", "manifest SHA-256"),
    ("resume_select_s", "resume selection"),
    ("listing_check_s", "rank-0 listing check"),
    ("manifest_receive_per_rank_s", "checked manifest received, per rank"),
    ("load_global_plan_s", "rank-0 load global plan"),
    ("dcp_global_plan_s", "DCP global plan *"),
    ("dcp_validate_s", "DCP plan validation *"),
    ("shardline_validate_s", "shardline plan validation *"),
    ("dcp_finish_s", "DCP finish *"),
    ("metadata_open_per_rank_s", "open .metadata, per rank *"),
    ("load_plan_per_rank_s", "load plan, per rank, torch's planner *"),
    ("load_plan_fast_per_rank_s", "load plan, per rank, shardline's *"),
]
PLOT_SIZES = [
    ("manifest_bytes", "manifest (bytes)"),
    ("statement_bytes", "statement (bytes)"),
    ("gathered_bytes", "gathered to rank 0 (bytes) *"),
    ("dcp_metadata_bytes", ".metadata (bytes) *"),
    ("objects_per_prefix", "objects per prefix (max)"),
    ("save_requests", "object-store requests of a save"),
]


def plot(rows: list[SimulatedSave], path: Path) -> Path:
    """Cost vs W on log-log axes: seconds (left; the one-second line dashed), sizes and counts (right)."""
    from shardline.diagnostics.bench.render import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    worlds = [r.world for r in rows]
    for ax, series in ((left, PLOT_SECONDS), (right, PLOT_SIZES)):
        for key, label in series:
            points = [(r.world, r.values[key]) for r in rows if r.values.get(key, 0) > 0 and key not in r.extrapolated]
            guessed = [(r.world, r.values[key]) for r in rows if key in r.extrapolated and r.values.get(key, 0) > 0]
            if not points:
                continue
            (line,) = ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=label)
            if guessed:  # extrapolated: dotted, from the last measured point
                ax.plot(*zip(points[-1], *guessed, strict=True), linestyle=":", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(worlds, [f"{w:,}" for w in worlds])
        ax.set_xlabel("ranks W (8 files each)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    left.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    left.set_ylabel("CPU seconds (one core)")
    right.set_ylabel("bytes / count")
    left.set_title("time: rank 0, or every rank (per rank)", fontsize=10)
    right.set_title("sizes and object-store counts", fontsize=10)
    fig.suptitle(
        "shardline's checkpoint protocol at W ranks, simulated (70B Llama, FULL_SHARD); * scaled from sampled "
        "tensors, dotted: extrapolated",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _load(path: Path) -> list[SimulatedSave]:
    """The rows a ``--json`` file holds."""
    return [SimulatedSave(**row) for row in json.loads(path.read_text())["rows"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    parser.add_argument("--files", type=int, default=8, help="data files per rank")
    parser.add_argument("--layers", type=int, default=LLAMA_70B.layers)
    parser.add_argument("--dcp-layers", type=int, default=1, help="decoder layers the DCP pieces run on (scaled)")
    parser.add_argument("--keep", type=int, default=3, help="committed checkpoints resume selection chooses from")
    parser.add_argument(
        "--validate-max-world", type=int, default=4096, help="largest W whose DCP plan validation (quadratic) runs"
    )
    parser.add_argument(
        "--layout",
        choices=("per_tensor", "packed", "packed_only"),
        default="per_tensor",
        help="packed: also the packed layout's planning; packed_only: only that (seconds, even at 16,384 ranks)",
    )
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--plot", type=Path, help="draw cost vs W (log-log) into this PNG (needs matplotlib)")
    parser.add_argument("--from-json", type=Path, help="print and plot the rows of an earlier --json; run nothing")
    args = parser.parse_args(argv)
    if args.plot is not None:
        from shardline.diagnostics.bench.render import require_matplotlib

        require_matplotlib()  # before a long run, not after it
    rows = _load(args.from_json) if args.from_json else []
    for w in [] if args.from_json else (int(x) for x in args.worlds.split(",")):
        t = time.perf_counter()
        if args.layout == "packed_only":
            packed = packed_costs(
                w, state_dict_keys(layers=args.layers), timed=timed, reps=3 if w <= 1024 else 1, files=args.files
            )
            rows.append(SimulatedSave(world=w, files=args.files, values=packed))
            continue
        rows.append(
            simulate(
                w,
                files=args.files,
                layers=args.layers,
                dcp_layers=args.dcp_layers,
                keep=args.keep,
                validate_max_world=args.validate_max_world,
                layout=args.layout,
            )
        )
        print(f"W={w}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    extrapolate(rows)
    if args.layout != "packed_only":
        print(markdown(rows, SAVE_COLUMNS) + "\n\n" + markdown(rows, LOAD_COLUMNS))
    if any("packed_metadata_items" in r.values for r in rows):
        columns = PACKED_COLUMNS
        if args.layout == "packed_only":  # no per-tensor figures to stand beside
            columns = [c for c in columns if not c[1].startswith("per-tensor")]
        print("\npacked layout:\n\n" + markdown(rows, columns))
    print("\n~ extrapolated from the two largest W measured (--validate-max-world)")
    print("\n* scaled from the sampled tensors (--dcp-layers) to all of them by count")
    if len(rows) > 1:
        print(
            "\nlog-log slope, smallest to largest W: " + ", ".join(f"{k} {e:.2f}" for k, e in exponents(rows).items())
        )
    if args.json and not args.from_json:
        data = {"load_average": os.getloadavg(), "rows": [dataclasses.asdict(r) for r in rows]}
        args.json.write_text(json.dumps(data, indent=1))
    if args.plot is not None:
        print(f"\nplot: {plot(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
