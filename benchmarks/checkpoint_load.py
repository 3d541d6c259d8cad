"""Benchmark: verified ``shardline.checkpoint.load`` vs plain ``torch.distributed.checkpoint.load`` at W ranks.

Both read the same checkpoint (written once by ``shardline.checkpoint.save``) into the same
sharded model and optimizer, on W gloo ranks on this machine, alternating runs and their order
so page-cache and CPU-frequency drift hit both alike. Plain DCP reads into the live shards and
checks nothing; shardline's default (``verify="full"``) hashes every byte against the manifest
-- each rank a disjoint share, while reading -- hashes ``.metadata`` before unpickling it,
agrees across ranks, then installs. Also shown: shardline at the ``sizes`` opt-in (no data
hashing), and one SHA-256 pass over a rank's share of the files (the verification budget).
Target: verified load <= 1.3x plain DCP load at W=2.

    python benchmarks/checkpoint_load.py --mib 192 --reps 6 [--world 2] [--dir /path/on/the/target/disk]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import shardline
import shardline.checkpoint as ckpt
from shardline.testing import run_distributed


def build(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, mib * 2**20 // (3 * 4 * width * width))  # params + 2 Adam moments, fp32
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    shardline.wrap(model, shardline.layer_policy(nn.Linear))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _timed(fn, cpu: list[float]) -> float:
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    cpu.append(time.process_time() - start_cpu)  # this rank, all its threads
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, world: int, root: str, mib: int, reps: int) -> dict[str, object]:
    warnings.simplefilter("ignore")
    model, optimizer = build(mib)
    path = Path(root) / "step-1"
    ckpt.save(path, model=model, optimizer=optimizer, step=1)
    files = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
    share = files[rank::world]

    def plain() -> None:
        state = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)

    def verified() -> None:
        ckpt.load(path, model=model, optimizer=optimizer)

    def sizes() -> None:
        ckpt.load(path, model=model, optimizer=optimizer, verify="sizes")

    def hash_share() -> None:
        for file in share:
            h = hashlib.sha256()
            with open(file, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)

    runs: dict[str, list[float]] = {"plain": [], "verified": [], "sizes": [], "sha256_share": []}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    order = [("plain", plain), ("verified", verified), ("sizes", sizes), ("sha256_share", hash_share)]
    _timed(plain, [])  # warm-up: page cache, allocator
    for i in range(reps):
        for name, fn in order if i % 2 == 0 else list(reversed(order)):
            runs[name].append(_timed(fn, cpu[name]))
    result: dict[str, object] = {name: statistics.median(times) for name, times in runs.items()}
    result.update({f"{name}_cpu": statistics.median(times) for name, times in cpu.items()})
    result["bytes"] = sum(f.stat().st_size for f in files)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192, help="approximate checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo, this machine)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="shardline-load-bench-", dir=args.dir)
    results = run_distributed(_rank, args.world, args=(root, args.mib, args.reps), timeout=590)
    r = results[0]
    ratio = float(r["verified"]) / float(r["plain"])  # type: ignore[arg-type]
    out = {
        "world_size": args.world,
        "bytes": r["bytes"],
        "reps": args.reps,
        "plain_dcp_load_s": r["plain"],
        "shardline_verified_load_s": r["verified"],
        "shardline_sizes_only_load_s": r["sizes"],
        "sha256_of_one_rank_share_s": r["sha256_share"],
        "plain_cpu_s_rank0": r["plain_cpu"],
        "verified_cpu_s_rank0": r["verified_cpu"],
        "verified_over_plain": ratio,
        "target_met": ratio <= 1.3,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    mib = int(r["bytes"]) / 2**20  # type: ignore[arg-type]
    print(
        f"checkpoint: {mib:.0f} MiB in {args.world} shard files, {args.world} ranks, "
        f"{args.reps} alternating runs, medians"
    )
    print(f"  plain torch.distributed.checkpoint.load        : {out['plain_dcp_load_s'] * 1e3:8.1f} ms")
    print(f"  shardline.checkpoint.load (verify=full)        : {out['shardline_verified_load_s'] * 1e3:8.1f} ms")
    print(f"  verified / plain                               : {ratio:8.2f}x (target <= 1.3x: {out['target_met']})")
    print(f"  shardline.checkpoint.load (verify=sizes)       : {out['shardline_sizes_only_load_s'] * 1e3:8.1f} ms")
    print(f"  one SHA-256 pass over a rank's share of files  : {out['sha256_of_one_rank_share_s'] * 1e3:8.1f} ms")
    print(
        f"  CPU time of rank 0, plain / verified           : {out['plain_cpu_s_rank0'] * 1e3:8.1f} / "
        f"{out['verified_cpu_s_rank0'] * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main()
