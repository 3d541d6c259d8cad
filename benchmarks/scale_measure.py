"""One W's measurements, for ``benchmarks/scale_sim.py`` (its module note says what each one is): shardline's
commit, DCP's save and load planning, resume selection, the side costs and the object-store requests, each run with
shardline's own code on the simulated ranks of ``scale_capture.py`` and ``scale_dcp.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import statistics
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
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from benchmarks.scale_capture import captured_checkpoint, rank_digests
from benchmarks.scale_dcp import Piece, item_results, local_save_plan, rank_chunk
from benchmarks.scale_layout import LLAMA_70B, fake_sha256, state_dict_keys
from benchmarks.scale_packed import packed_costs
from benchmarks.scale_requests import object_store_requests
from benchmarks.scale_rows import SimulatedSave
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
from shardline.checkpoint.lifecycle.resume import find_candidates
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.storage.stores import locate

__all__ = ["simulate", "timed"]


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
    """Run the protocol's rank-0 and per-rank planning code for ``world`` ranks (``scale_sim``'s module note).

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
        results_per_rank = [item_results(p, r, files) for r, p in enumerate(global_plan)]
        if layout == "packed":
            v.update(packed_costs(world, tensors, timed=timed, reps=reps, files=files))

        def finish() -> tuple[Metadata, bytes]:  # FileSystemWriter.finish: every result's storage data, pickled
            storage: dict[MetadataIndex, Any] = {}
            for results in results_per_rank:
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
        dcp_gathered = sum(len(pickle.dumps(r)) for r in results_per_rank) * scale

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
                items += create_read_items_for_chunk_list(t.key, saved, [rank_chunk(t, world, rank)])
            return items

        t, torch_items = timed(lambda: rank_plan(mid), reps)
        v["load_plan_per_rank_s"] = t * scale

        def fast_plan(rank: int, rounds: int) -> list[ReadItem]:  # shardline's planner, as a load runs it
            state = {t.key: Piece(t.shape, rank_chunk(t, world, rank)) for t in sample}
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
        for results in results_per_rank:  # same world and layout: each rank reads back its own items
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
        v.update(object_store_requests([*digests, metadata_digest], records_sizes, world))
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
