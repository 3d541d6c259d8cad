"""Benchmark: shardline.checkpoint.save (hash while writing + manifest + atomic commit) vs plain DCP save.

Same process (or, with ``--world W``, the same W gloo ranks on this machine, every save started
together after a barrier; rank 0's timings are reported), same state dict, alternating runs (so
page-cache and CPU-frequency drift hit both alike). Reports medians and the cost of one
in-memory SHA-256 pass over the same bytes; then, at W=1, with
``CheckpointManager(async_save=True)``, how long the training loop blocks per checkpoint. The
load side (verified load vs plain DCP load at W ranks) is ``benchmarks/checkpoint_load.py``.

Both build the state dict from the model inside the timed region (plain DCP with the same
``model_state_dict``/``optimizer_state_dict`` shardline's save uses; the time is printed apart).
Both write the same number of files per rank (``--files``; default: shardline's automatic count,
the cores of this machine at W=1), plain DCP through ``FileSystemWriter(thread_count=files)``,
so the comparison is of hashing and commit alone. Target: shardline's save at most 1.03x plain,
judged on the median of the per-rep ratios (the two saves of a rep run back to back), with a
95% interval from resampling the reps; before each timed save the disk is settled (``os.sync``
and ``--settle`` seconds), so no save pays for the flush of the previous one's deletion.

    python -m benchmarks.checkpoint_save --mib 192 --reps 40 --no-async [--world W] [--files N]
        [--also-without-writeback] [--dir /path/on/the/target/disk]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import shardline
import shardline.checkpoint as ckpt
from shardline.checkpoint.coordination.parallelism import resolve_files_per_rank
from shardline.checkpoint.integrity import hashing as hashing_module
from shardline.testing import run_distributed


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
    model: nn.Module, optimizer: torch.optim.Optimizer, *, root: Path, files: int, reps: int, settle: float, late: bool
) -> dict[str, list[float]]:
    """Each rep: one SHA-256 pass over this rank's bytes, then plain DCP's save and shardline's (and with ``late``,
    shardline's without early writeback), in alternating order; the seconds of each, as this rank saw them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    views = local_bytes({"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)})
    runs: dict[str, list[float]] = {"plain": [], "ours": [], "late": [], "hashing": [], "building": []}
    kinds = ["plain", "ours"] + (["late"] if late else [])
    for i in range(reps):
        t = time.perf_counter()
        h = hashlib.sha256()
        for v in views:
            h.update(v)
        runs["hashing"].append(time.perf_counter() - t)

        # Note: the order alternates too, so neither save always runs while the other's pages
        # are being written back.
        for which in kinds if i % 2 == 0 else kinds[::-1]:
            target = root / f"{which}-{i}"
            if settle > 0:
                os.sync()
                time.sleep(settle)
            if world > 1:
                dist.barrier()  # every rank starts the save together
            t = time.perf_counter()
            if which == "plain":
                # Plain DCP saves a state dict built from the model, as a training loop builds it for every
                # save (and as shardline's save builds it): the same functions on both sides.
                built = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
                runs["building"].append(time.perf_counter() - t)
                dcp.save(built, storage_writer=dcp.FileSystemWriter(target, thread_count=files))
            elif which == "ours":
                ckpt.save(target, model=model, optimizer=optimizer, step=i, files_per_rank=files)
            else:
                every, hashing_module._WRITEBACK_EVERY = hashing_module._WRITEBACK_EVERY, None
                try:
                    ckpt.save(target, model=model, optimizer=optimizer, step=i, files_per_rank=files)
                finally:
                    hashing_module._WRITEBACK_EVERY = every
            runs[which].append(time.perf_counter() - t)
        if world > 1:
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            for which in kinds:
                shutil.rmtree(root / f"{which}-{i}")
    runs["bytes"] = [float(sum(v.nbytes for v in views))]
    return runs


def _rank(
    rank: int, world: int, root: str, mib: int, files: int, reps: int, settle: float, late: bool
) -> dict[str, list[float]]:
    warnings.simplefilter("ignore")
    model, optimizer = build(mib)
    count = resolve_files_per_rank(files)
    runs = _timed_saves(model, optimizer, root=Path(root), files=count, reps=reps, settle=settle, late=late)
    runs["files"] = [float(count)]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="approximate checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--files", type=int, default=0, help="files per rank, both saves (0: the automatic count)")
    parser.add_argument("--no-async", action="store_true", help="skip the async part (always skipped at --world > 1)")
    parser.add_argument("--world", type=int, default=1, help="ranks (gloo, this machine); timings are rank 0's")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.2,
        help="seconds to wait after an os.sync() before each timed save (0: none), so that no save starts while "
        "the disk still flushes the previous one's deletion",
    )
    parser.add_argument(
        "--also-without-writeback",
        action="store_true",
        help="time a third save, shardline's without starting the writeback early: the hashing and commit alone",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    root = Path(args.dir or tempfile.mkdtemp(prefix="shardline-bench-"))
    blocked: list[float] = []  # the async part: W=1 only
    waited: list[float] = []
    work: list[float] = []
    if args.world > 1:  # ranks on this machine; rank 0's timings (a save is a collective: all end together)
        runs = run_distributed(
            _rank,
            args.world,
            args=(str(root), args.mib, args.files, args.reps, args.settle, args.also_without_writeback),
            timeout=590,
        )[0]
        files = int(runs["files"][0])
    else:
        shardline.init_distributed(backend="gloo")
        files = resolve_files_per_rank(args.files)
        model, optimizer = build(args.mib)
        runs = _timed_saves(
            model,
            optimizer,
            root=root,
            files=files,
            reps=args.reps,
            settle=args.settle,
            late=args.also_without_writeback,
        )
        manager = ckpt.CheckpointManager(root / "async", async_save=True, files_per_rank=files)
        for step in range(1, 0 if args.no_async else args.reps + 1):
            # save() first waits for the previous checkpoint's write; time that apart from staging
            t = time.perf_counter()
            manager.wait()
            waited.append(time.perf_counter() - t)
            t = time.perf_counter()
            manager.save(ckpt.SaveRequest(step=step, model=model, optimizer=optimizer, state={"step": step}))
            blocked.append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(3):  # "training" while the previous checkpoint is written
                model(torch.randn(64, 1024)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            work.append(time.perf_counter() - t)
        manager.close()
        shutil.rmtree(root / "async")
    plain, ours, late, hashing, building = (runs[k] for k in ("plain", "ours", "late", "hashing", "building"))
    nbytes = int(runs["bytes"][0])

    med = statistics.median
    ratios = [o / p for o, p in zip(ours, plain, strict=True)]
    # A 95% interval of that median, by resampling the reps (fixed seed: the same runs give the same interval).
    rng = np.random.default_rng(0)
    boot = np.median(rng.choice(np.array(ratios), size=(2000, len(ratios))), axis=1)
    interval = (float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975)))
    result = {
        "bytes": nbytes,
        "world_size": args.world,
        "files_per_rank": files,
        "reps": args.reps,
        "plain_dcp_save_s": med(plain),
        "shardline_save_s": med(ours),
        "extra_s": med(ours) - med(plain),
        "shardline_over_plain": med(ours) / med(plain),
        "target_met": med(ratios) <= 1.03,
        # Each rep's two saves run back to back, so a slow spell of the disk hits both: the median of the
        # per-rep ratios is steadier than the ratio of the medians when fsync times wander.
        "paired_ratio_median": med(ratios),
        "paired_ratio_quartiles": tuple(statistics.quantiles(ratios, n=4)[::2]) if args.reps >= 2 else None,
        "paired_ratio_median_95ci": interval,
        "plain_range_s": (min(plain), max(plain)),
        "shardline_range_s": (min(ours), max(ours)),
        "sha256_pass_s": med(hashing),
        "state_dict_build_s": med(building),
        "sha256_GBps": nbytes / med(hashing) / 1e9,
        "extra_within_one_sha256_pass": med(ours) - med(plain) <= med(hashing),
        "without_writeback_save_s": med(late) if late else None,
        "without_writeback_paired_ratio_median": med(a / b for a, b in zip(late, plain, strict=True)) if late else None,
        "async_blocking_s": med(blocked) if blocked else None,
        "async_waiting_for_previous_write_s": med(waited) if waited else None,
        "async_training_between_saves_s": med(work) if work else None,
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"state dict: {nbytes / 2**20:.0f} MiB per rank at W={args.world}, in {files} file(s) per rank, "
        f"{args.reps} alternating runs, medians"
    )
    lo, hi = (x * 1e3 for x in result["plain_range_s"])
    print(
        f"  plain torch.distributed.checkpoint.save : {result['plain_dcp_save_s'] * 1e3:8.1f} ms  "
        f"(min {lo:.1f}, max {hi:.1f})"
    )
    lo, hi = (x * 1e3 for x in result["shardline_range_s"])
    print(
        f"  shardline.checkpoint.save (lineage)     : {result['shardline_save_s'] * 1e3:8.1f} ms  "
        f"(min {lo:.1f}, max {hi:.1f})"
    )
    print(f"  extra                                   : {result['extra_s'] * 1e3:8.1f} ms")
    print(f"  building the state dict (in both)       : {result['state_dict_build_s'] * 1e3:8.1f} ms")
    print(f"  shardline / plain (ratio of medians)    : {result['shardline_over_plain']:8.3f}x")
    if result["paired_ratio_quartiles"] is not None:
        q1, q3 = result["paired_ratio_quartiles"]
        lo, hi = result["paired_ratio_median_95ci"]
        print(f"  per-rep ratio, median (quartiles)       : {result['paired_ratio_median']:8.3f}x ({q1:.3f}-{q3:.3f})")
        met = result["target_met"]
        print(f"  95% interval of that median             : {lo:.3f}-{hi:.3f}x (target <= 1.03x: {met})")
    if late:
        print(
            f"  shardline, writeback left to the fsync  : {result['without_writeback_save_s'] * 1e3:8.1f} ms  "
            f"(per-rep ratio to plain, median {result['without_writeback_paired_ratio_median']:.3f}x)"
        )
    print(f"  one in-memory SHA-256 pass (budget)     : {result['sha256_pass_s'] * 1e3:8.1f} ms")
    print(f"  extra within budget                     : {result['extra_within_one_sha256_pass']}")
    if blocked:  # measured (W=1, without --no-async)
        blocked_ms, waited_ms = result["async_blocking_s"] * 1e3, result["async_waiting_for_previous_write_s"] * 1e3
        print(f"  async: training loop blocked per save   : {blocked_ms:8.1f} ms (staging + check)")
        print(f"  async: waiting for the previous write   : {waited_ms:8.1f} ms")


if __name__ == "__main__":
    main()
