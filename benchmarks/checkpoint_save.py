"""Benchmark: shardline.checkpoint.save (hash while writing + manifest + atomic commit) vs plain DCP save.

Same process (or, with ``--world W``, the same W gloo ranks on this machine, every save started
together after a barrier; rank 0's timings are reported), same state dict, alternating runs (so
page-cache and CPU-frequency drift hit both alike). Each rep also hashes the rank's bytes in
memory, on one thread and on as many threads as the save may hash files at once, and records
each save's CPU time: from these, the physical floor of that rep (:mod:`benchmarks.floors`), and
shardline's distance from it. Then, at W=1, the async save's blocking time (staging) against
plain DCP's ``async_save``. The load side is ``benchmarks/checkpoint_load.py``; the whole table
over storage classes, sizes and world sizes is ``benchmarks/checkpoint_matrix.py``.

Both build the state dict from the model inside the timed region (plain DCP with the same
``model_state_dict``/``optimizer_state_dict`` shardline's save uses). Both write the same number
of files per rank (``--files``; default: shardline's automatic count, the cores of this machine
at W=1), plain DCP through ``FileSystemWriter(thread_count=files)``, with DCP's fsyncs.
shardline hashes and flushes as the location's calibration decided
(``shardline/checkpoint/storage/calibration.py``; printed); ``--also-fixed`` times a third save
with the calibration off (the fixed behaviour). Targets: where the floor is the plain save,
shardline's save at most 1.03x plain; elsewhere within 5% of the floor; judged on the median of
the per-rep ratios, with a 95% interval from resampling the reps. Before each timed save the
disk is settled (``os.sync`` and ``--settle`` seconds). ``--layout packed`` times shardline's saves
in the packed layout (plain DCP stays per tensor, the reference).

    python -m benchmarks.checkpoint_save --mib 192 --reps 30 --no-async [--world W] [--files N]
        [--layout per_tensor|packed] [--also-fixed] [--recalibrate] [--dir /path/on/the/target/disk] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import shardline
import shardline.checkpoint as ckpt
from benchmarks.floors import (
    RECORD_SIZES,
    FixedCost,
    durable_floor_s,
    fixed_cost,
    floor_s,
    hash_in_parallel,
    interval,
    median_ratio,
)
from shardline.checkpoint.coordination.parallelism import available_cores, cores_per_rank, resolve_files_per_rank
from shardline.checkpoint.integrity.manifest import MANIFEST, MANIFEST_HASH_FILE, SUMS_FILE
from shardline.checkpoint.provenance.statement import STATEMENT_FILE
from shardline.checkpoint.storage import calibration
from shardline.testing import run_distributed

RECORDS = (MANIFEST, STATEMENT_FILE, MANIFEST_HASH_FILE, SUMS_FILE)  # in the order of floors.RECORD_SIZES


def build(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, mib * 2**20 // (3 * 4 * width * width))  # params + 2 Adam moments, fp32
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    shardline.wrap(model, shardline.layer_policy(nn.Linear))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def local_bytes(obj: object) -> list[memoryview]:
    out: list[memoryview] = []
    if isinstance(obj, dict):
        for v in obj.values():
            out += local_bytes(v)
    elif isinstance(obj, list):
        for v in obj:
            out += local_bytes(v)
    elif isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        if t.numel():
            out.append(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return out


def _timed_saves(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    root: Path,
    files: int,
    reps: int,
    settle: float,
    fixed: bool,
    layout: str = "per_tensor",
) -> dict[str, list[float]]:
    """Each rep: the SHA-256 of this rank's bytes (one thread; the threads the save may hash with), then plain
    DCP's save and shardline's (and with ``fixed``, shardline's with the calibration off), in alternating order;
    the seconds and CPU seconds of each, as this rank saw them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    views = local_bytes({"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)})
    threads = max(1, min(files, cores_per_rank()))
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            *("plain", "ours", "fixed", "plain_cpu", "ours_cpu", "fixed_cpu", "hash1", "hashk", "building"),
            *("durable_records", "durable_ledger", "round_trips"),
        )
    }
    kinds = ["plain", "ours"] + (["fixed"] if fixed else [])
    for i in range(reps):
        if world > 1:
            dist.barrier()  # the ranks hash together, as they save together
        runs["hash1"].append(hash_in_parallel(views, 1))
        runs["hashk"].append(hash_in_parallel(views, threads))

        # Note: the order alternates too, so neither save always runs while the other's pages
        # are being written back.
        for which in kinds if i % 2 == 0 else kinds[::-1]:
            target = root / f"{which}-{i}"
            if settle > 0:
                os.sync()
                time.sleep(settle)
            if world > 1:
                dist.barrier()  # every rank starts the save together
            t, c = time.perf_counter(), time.process_time()
            if which == "plain":
                # Plain DCP saves a state dict built from the model, as a training loop builds it for every
                # save (and as shardline's save builds it): the same functions on both sides.
                built = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
                runs["building"].append(time.perf_counter() - t)
                dcp.save(built, storage_writer=dcp.FileSystemWriter(target, thread_count=files))
            elif which == "ours":
                ckpt.save(target, model=model, optimizer=optimizer, step=i, files_per_rank=files, layout=layout)
            else:
                os.environ[calibration.ENV] = "off"
                try:
                    ckpt.save(target, model=model, optimizer=optimizer, step=i, files_per_rank=files, layout=layout)
                finally:
                    del os.environ[calibration.ENV]
            runs[which].append(time.perf_counter() - t)
            runs[f"{which}_cpu"].append(time.process_time() - c)
        # The durable floor's fixed term, on the same storage in the same rep (and the same process group), with
        # the commit records at the sizes this rep's save wrote.
        saved = root / f"ours-{i}"
        sizes = [(saved / name).stat().st_size for name in RECORDS] if saved.is_dir() else RECORD_SIZES
        term = fixed_cost(root, record_sizes=sizes)
        runs["durable_records"].append(term.records_s)
        runs["durable_ledger"].append(term.ledger_s)
        runs["round_trips"].append(term.round_trips_s)
        if world > 1:
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            for which in kinds:
                shutil.rmtree(root / f"{which}-{i}")
    runs["bytes"] = [float(sum(v.nbytes for v in views))]
    runs["threads"] = [float(threads)]
    return runs


def _tuning(root: Path, files: int, recalibrate: bool) -> calibration.SaveTuning:
    """The calibration the saves will use at ``root`` (probed now with ``recalibrate``)."""
    probe_dir = Path(tempfile.mkdtemp(prefix=".calibrate-", dir=root))
    before = os.environ.get(calibration.ENV)
    if recalibrate:
        os.environ[calibration.ENV] = "force"
    try:
        return calibration.tuning_for(probe_dir, writers=files, cores=cores_per_rank())
    finally:
        if recalibrate:
            if before is None:
                del os.environ[calibration.ENV]
            else:
                os.environ[calibration.ENV] = before
        shutil.rmtree(probe_dir)


def _rank(
    rank: int,
    world: int,
    root: str,
    mib: int,
    files: int,
    reps: int,
    settle: float,
    fixed: bool,
    recalibrate: bool,
    layout: str = "per_tensor",
) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    model, optimizer = build(mib)
    count = resolve_files_per_rank(files)
    tuning = _tuning(Path(root), count, recalibrate and rank == 0)
    dist.barrier()
    runs: dict[str, Any] = _timed_saves(
        model, optimizer, root=Path(root), files=count, reps=reps, settle=settle, fixed=fixed, layout=layout
    )
    runs["files"] = [float(count)]
    runs["layout"] = layout
    runs["tuning"] = asdict(tuning)
    return runs


def _async(
    root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, files: int, reps: int, layout: str = "per_tensor"
) -> dict[str, list[float]]:
    """Per rep: how long ``dcp.async_save`` and ``CheckpointManager(async_save=True).save`` block the caller
    (staging; shardline's also hashes the staged bytes), each with no write in flight; alternating order."""
    manager = ckpt.CheckpointManager(root / "async", async_save=True, files_per_rank=files, layout=layout)
    out: dict[str, list[float]] = {"plain": [], "ours": []}
    for step in range(1, reps + 1):
        for which in ("plain", "ours") if step % 2 else ("ours", "plain"):
            if which == "plain":
                built = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
                writer = dcp.FileSystemWriter(root / f"plain-async-{step}", thread_count=files)
                t = time.perf_counter()
                future = dcp.async_save(built, storage_writer=writer)
                out["plain"].append(time.perf_counter() - t)
                future.result()
                shutil.rmtree(root / f"plain-async-{step}")
            else:
                t = time.perf_counter()
                manager.save(ckpt.SaveRequest(step=step, model=model, optimizer=optimizer, state={"step": step}))
                out["ours"].append(time.perf_counter() - t)
                manager.wait()
    manager.close()
    shutil.rmtree(root / "async")
    return out


def _summary(runs: dict[str, Any], *, world: int, reps: int) -> dict[str, Any]:
    med = statistics.median
    plain, ours, fixed = runs["plain"], runs["ours"], runs["fixed"]
    cores = cores_per_rank() if world == 1 else max(1, available_cores() // world)
    floors = [
        floor_s(plain_s=p, plain_cpu_s=pc, hash_one_thread_s=h1, hash_parallel_s=hk, cores=cores)
        for p, pc, h1, hk in zip(plain, runs["plain_cpu"], runs["hash1"], runs["hashk"], strict=True)
    ]
    floor_is_plain = med(f / p for f, p in zip(floors, plain, strict=True)) <= 1.0 + 1e-9
    vs_plain, vs_floor = median_ratio(ours, plain), median_ratio(ours, floors)
    # shardline.checkpoint.save records no ledger row: its fixed term is the records' durability and two round trips.
    terms = [
        FixedCost(records_s=m, ledger_s=lg, round_trips_s=r)
        for m, lg, r in zip(runs["durable_records"], runs["durable_ledger"], runs["round_trips"], strict=True)
    ]
    durable = [durable_floor_s(floor=f, fixed=t, ledger=False) for f, t in zip(floors, terms, strict=True)]
    return {
        "layout": runs["layout"],
        "bytes": int(runs["bytes"][0]),
        "world_size": world,
        "files_per_rank": int(runs["files"][0]),
        "cores_per_rank": cores,
        "hash_threads": int(runs["threads"][0]),
        "reps": reps,
        "tuning": runs["tuning"],
        "plain_dcp_save_s": med(plain),
        "shardline_save_s": med(ours),
        "plain_range_s": (min(plain), max(plain)),
        "shardline_range_s": (min(ours), max(ours)),
        "plain_cpu_s": med(runs["plain_cpu"]),
        "shardline_cpu_s": med(runs["ours_cpu"]),
        "sha256_one_thread_s": med(runs["hash1"]),
        "sha256_parallel_s": med(runs["hashk"]),
        "state_dict_build_s": med(runs["building"]),
        "floor_s": med(floors),
        "floor_is_plain": floor_is_plain,
        "paired_ratio_median": vs_plain,
        "paired_ratio_median_95ci": interval(ours, plain),
        "over_floor_median": vs_floor,
        "over_floor_median_95ci": interval(ours, floors),
        "records_durable_s": med(runs["durable_records"]),
        "ledger_commit_s": med(runs["durable_ledger"]),
        "round_trips_s": med(runs["round_trips"]),
        "fixed_term_s": med(t.total_s(ledger=False) for t in terms),
        "durable_floor_s": med(durable),
        "over_durable_floor_median": median_ratio(ours, durable),
        "over_durable_floor_median_95ci": interval(ours, durable),
        "target": "<= 1.03x plain" if floor_is_plain else "<= 1.05x floor",
        "target_met": vs_plain <= 1.03 if floor_is_plain else vs_floor <= 1.05,
        "fixed_save_s": med(fixed) if fixed else None,
        "fixed_paired_ratio_median": median_ratio(fixed, plain) if fixed else None,
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="approximate checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--files", type=int, default=0, help="files per rank, both saves (0: the automatic count)")
    parser.add_argument(
        "--no-async", action="store_true", help="skip the async part (at most 6 reps; always skipped at --world > 1)"
    )
    parser.add_argument("--world", type=int, default=1, help="ranks (gloo, this machine); timings are rank 0's")
    parser.add_argument(
        "--layout",
        choices=("per_tensor", "packed"),
        default="per_tensor",
        help="layout of shardline's saves (plain DCP's is per tensor, the reference)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.2,
        help="seconds to wait after an os.sync() before each timed save (0: none), so that no save starts while "
        "the disk still flushes the previous one's deletion",
    )
    parser.add_argument(
        "--also-fixed",
        action="store_true",
        help="time a third save, shardline's with the calibration off (SHARDLINE_SAVE_CALIBRATION=off)",
    )
    parser.add_argument(
        "--recalibrate", action="store_true", help="probe the location again first (instead of a cached probe)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layout = args.layout
    warnings.simplefilter("ignore")
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardline-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    staging: dict[str, list[float]] = {}
    if args.world > 1:  # ranks on this machine; rank 0's timings (a save is a collective: all end together)
        runs = run_distributed(
            _rank,
            args.world,
            args=(str(root), args.mib, args.files, args.reps, args.settle, args.also_fixed, args.recalibrate, layout),
            timeout=590,
        )[0]
    else:
        shardline.init_distributed(backend="gloo")
        runs = _rank(
            0, 1, str(root), args.mib, args.files, args.reps, args.settle, args.also_fixed, args.recalibrate, layout
        )
        if not args.no_async:
            model, optimizer = build(args.mib)
            staging = _async(root, model, optimizer, int(runs["files"][0]), min(args.reps, 6), layout)
    result = _summary(runs, world=args.world, reps=args.reps)
    if staging:
        result["async_blocking_plain_s"] = statistics.median(staging["plain"])
        result["async_blocking_shardline_s"] = statistics.median(staging["ours"])
        result["async_blocking_paired_ratio_median"] = median_ratio(staging["ours"], staging["plain"])
        # Note: the async floor. Staging is a copy (CPU-bound): its time is its CPU work; shardline's also hashes
        # the staged bytes (so the write can be checked against them), on the rank's cores beside the copy.
        cores = cores_per_rank()
        plain_block, hash_one = result["async_blocking_plain_s"], result["sha256_one_thread_s"]
        result["async_blocking_floor_s"] = max(plain_block, (plain_block + hash_one) / cores)
        result["async_blocking_over_floor"] = result["async_blocking_shardline_s"] / result["async_blocking_floor_s"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    _print(result)


def _print(result: dict[str, Any]) -> None:
    ms = {k: v * 1e3 for k, v in result.items() if k.endswith("_s") and isinstance(v, float)}
    tuning = result["tuning"]
    print(
        f"state dict: {result['bytes'] / 2**20:.0f} MiB per rank at W={result['world_size']} ({result['layout']}), "
        f"{result['files_per_rank']} file(s) and {result['cores_per_rank']} core(s) per rank, {result['reps']} "
        f"alternating runs, medians (load average {result['load_average']:.1f})"
    )
    print(f"  calibration ({tuning['source']}): {tuning['reason']}")
    lo, hi = (x * 1e3 for x in result["plain_range_s"])
    print(f"  plain torch.distributed.checkpoint.save : {ms['plain_dcp_save_s']:8.1f} ms  (min {lo:.1f}, max {hi:.1f})")
    lo, hi = (x * 1e3 for x in result["shardline_range_s"])
    print(f"  shardline.checkpoint.save (lineage)     : {ms['shardline_save_s']:8.1f} ms  (min {lo:.1f}, max {hi:.1f})")
    print(f"  CPU time, plain / shardline             : {ms['plain_cpu_s']:8.1f} / {ms['shardline_cpu_s']:.1f} ms")
    print(
        f"  SHA-256 of the rank's bytes             : {ms['sha256_one_thread_s']:8.1f} ms on 1 thread, "
        f"{ms['sha256_parallel_s']:.1f} ms on {result['hash_threads']}"
    )
    what = "the plain save" if result["floor_is_plain"] else "above the plain save"
    print(f"  floor (benchmarks/floors.py)            : {ms['floor_s']:8.1f} ms ({what})")
    lo, hi = result["paired_ratio_median_95ci"]
    print(f"  shardline / plain, per-rep median       : {result['paired_ratio_median']:8.3f}x ({lo:.3f}-{hi:.3f})")
    lo, hi = result["over_floor_median_95ci"]
    print(f"  shardline / floor, per-rep median       : {result['over_floor_median']:8.3f}x ({lo:.3f}-{hi:.3f})")
    print(
        f"  durable floor (floor + fixed term)      : {ms['durable_floor_s']:8.1f} ms (commit records durable "
        f"{ms['records_durable_s']:.1f} + two round trips {ms['round_trips_s']:.2f} ms; a ledger commit, not counted "
        f"here, {ms['ledger_commit_s']:.1f} ms)"
    )
    lo, hi = result["over_durable_floor_median_95ci"]
    ratio = result["over_durable_floor_median"]
    print(f"  shardline / durable floor, median       : {ratio:8.3f}x ({lo:.3f}-{hi:.3f})")
    print(f"  target {result['target']:32s} : {result['target_met']}")
    if result["fixed_save_s"] is not None:
        print(
            f"  shardline, calibration off (fixed)      : {ms['fixed_save_s']:8.1f} ms  "
            f"(per-rep ratio to plain, median {result['fixed_paired_ratio_median']:.3f}x)"
        )
    if "async_blocking_plain_s" in result:
        print(
            f"  async: blocked per save, plain / ours   : {ms['async_blocking_plain_s']:8.1f} / "
            f"{ms['async_blocking_shardline_s']:.1f} ms "
            f"(per-rep ratio {result['async_blocking_paired_ratio_median']:.2f}x; floor "
            f"{ms['async_blocking_floor_s']:.1f} ms, {result['async_blocking_over_floor']:.2f}x of it)"
        )


if __name__ == "__main__":
    main()
