"""Benchmark: verified ``shardline.checkpoint.load`` vs plain ``torch.distributed.checkpoint.load`` at W ranks.

Both read the same checkpoint (written once by ``shardline.checkpoint.save``) into the same
sharded model and optimizer, on W gloo ranks on this machine, alternating runs and their order
so page-cache and CPU-frequency drift hit both alike; with ``--cache cold`` the checkpoint's
pages are dropped from the page cache before every run (``posix_fadvise(DONTNEED)``, no root
needed), as when a job resumes from disk. Plain DCP reads into the live shards and
checks nothing; shardline's default (``verify="full"``) hashes every byte against the manifest
-- each rank a disjoint share, while reading -- hashes ``.metadata`` before unpickling it,
agrees across ranks, then installs. Also shown: shardline at the ``sizes`` opt-in (no data
hashing), and one SHA-256 pass over a rank's share of the files (the verification budget).
The checkpoint has ``--files`` files per rank (default: shardline's automatic count). With
``--layout packed`` shardline's loads read a packed checkpoint of the same state (plain DCP, which
cannot read one, still reads the per-tensor one). Targets: verified load <= 1.3x plain DCP load
from the page cache, <= 1.15x cold.

    python benchmarks/checkpoint_load.py --mib 192 --reps 6 [--world 2] [--files N] [--cache both] [--dir DIR]
        [--layout per_tensor|packed]
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
from benchmarks.floors import load_fixed_cost
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


def _evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (they are clean: the save fsynced them)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn, cpu: list[float], evict: list[Path] | None = None) -> float:
    if evict is not None:
        _evict(evict)
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    cpu.append(time.process_time() - start_cpu)  # this rank, all its threads
    dist.barrier()
    return time.perf_counter() - start


def _rank(
    rank: int, world: int, root: str, mib: int, reps: int, cold: bool, files_per_rank: int, layout: str = "per_tensor"
) -> dict[str, object]:
    warnings.simplefilter("ignore")
    model, optimizer = build(mib)
    path = Path(root) / "step-1"
    ckpt.save(path, model=model, optimizer=optimizer, step=1, files_per_rank=files_per_rank)
    ours = path  # what shardline's loads read: the same checkpoint, or with --layout packed a packed one
    if layout != "per_tensor":
        ours = Path(root) / "packed-step-1"
        ckpt.save(ours, model=model, optimizer=optimizer, step=1, files_per_rank=files_per_rank, layout=layout)
    files = sorted(p for p in ours.iterdir() if p.suffix == ".distcp")
    share = [f for f in files if f.name.startswith(f"__{rank}_")]
    evict = sorted([*path.iterdir(), *(ours.iterdir() if ours != path else ())]) if cold else None

    def plain() -> None:
        state = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)

    def verified() -> None:
        ckpt.load(ours, model=model, optimizer=optimizer)

    def sizes() -> None:
        ckpt.load(ours, model=model, optimizer=optimizer, verify="sizes")

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
    fixed: list[float] = []
    for i in range(reps):
        for name, fn in order if i % 2 == 0 else list(reversed(order)):
            runs[name].append(_timed(fn, cpu[name], evict))
        # The verification floor's fixed term, on the same checkpoint in the same rep (and the same process group).
        fixed.append(load_fixed_cost(path / "manifest.json").total_s())
    result: dict[str, object] = {name: statistics.median(times) for name, times in runs.items()}
    result.update({f"{name}_cpu": statistics.median(times) for name, times in cpu.items()})
    result.update({f"{name}_range": (min(times), max(times)) for name, times in runs.items()})
    result["fixed"] = statistics.median(fixed)
    result["bytes"] = sum(f.stat().st_size for f in files)
    result["files"] = len(files)
    result["layout"] = layout
    return result


def _report(r: dict[str, object], world: int, reps: int, cache: str) -> dict[str, object]:
    ratio = float(r["verified"]) / float(r["plain"])  # type: ignore[arg-type]
    target = 1.15 if cache == "cold" else 1.3
    out = {
        "cache": cache,
        "layout": r["layout"],
        "world_size": world,
        "files": r["files"],
        "bytes": r["bytes"],
        "reps": reps,
        "plain_dcp_load_s": r["plain"],
        "shardline_verified_load_s": r["verified"],
        "shardline_sizes_only_load_s": r["sizes"],
        "sha256_of_one_rank_share_s": r["sha256_share"],
        "verification_fixed_s": r["fixed"],
        "plain_cpu_s_rank0": r["plain_cpu"],
        "verified_cpu_s_rank0": r["verified_cpu"],
        "plain_range": r["plain_range"],
        "verified_range": r["verified_range"],
        "verified_over_plain": ratio,
        "target": target,
        "target_met": ratio <= target,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }
    return out


def _print(out: dict[str, object]) -> None:
    mib = int(out["bytes"]) / 2**20  # type: ignore[arg-type]
    print(
        f"{out['cache']} page cache -- checkpoint ({out['layout']}): {mib:.0f} MiB in {out['files']} shard files, "
        f"{out['world_size']} ranks, {out['reps']} alternating runs, medians"
    )
    ms = {k: float(v) * 1e3 for k, v in out.items() if k.endswith(("_s", "_s_rank0"))}  # type: ignore[arg-type]
    lo, hi = (float(x) * 1e3 for x in out["plain_range"])  # type: ignore[union-attr]
    print(
        f"  plain torch.distributed.checkpoint.load        : {ms['plain_dcp_load_s']:8.1f} ms  "
        f"(min {lo:.1f}, max {hi:.1f})"
    )
    lo, hi = (float(x) * 1e3 for x in out["verified_range"])  # type: ignore[union-attr]
    print(
        f"  shardline.checkpoint.load (verify=full)        : {ms['shardline_verified_load_s']:8.1f} ms  "
        f"(min {lo:.1f}, max {hi:.1f})"
    )
    print(
        f"  verified / plain                               : {out['verified_over_plain']:8.2f}x "
        f"(target <= {out['target']}x: {out['target_met']})"
    )
    print(f"  shardline.checkpoint.load (verify=sizes)       : {ms['shardline_sizes_only_load_s']:8.1f} ms")
    print(f"  one thread's SHA-256 of a rank's files         : {ms['sha256_of_one_rank_share_s']:8.1f} ms")
    print(f"  verification's fixed work (manifest, 1 trip)   : {ms['verification_fixed_s']:8.1f} ms")
    print(
        f"  CPU time of rank 0, plain / verified           : {ms['plain_cpu_s_rank0']:8.1f} / "
        f"{ms['verified_cpu_s_rank0']:.1f} ms (load {out['load_average']:.1f} on {out['cpus']} cores)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192, help="approximate checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo, this machine)")
    parser.add_argument(
        "--cache",
        choices=("hot", "cold", "both"),
        default="both",
        help="hot: files in the page cache (CPU-bound, the worst case for hashing); cold: dropped before "
        "every run (a resume from disk); both (default)",
    )
    parser.add_argument("--files", type=int, default=0, help="files per rank (0: shardline's automatic count)")
    parser.add_argument(
        "--layout",
        choices=("per_tensor", "packed"),
        default="per_tensor",
        help="layout of the checkpoint shardline's loads read (plain DCP reads a per-tensor one)",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    outs = []
    for cache in ("hot", "cold") if args.cache == "both" else (args.cache,):
        root = tempfile.mkdtemp(prefix="shardline-load-bench-", dir=args.dir)
        results = run_distributed(
            _rank, args.world, args=(root, args.mib, args.reps, cache == "cold", args.files, args.layout), timeout=590
        )
        outs.append(_report(results[0], args.world, args.reps, cache))
    if args.json:
        print(json.dumps(outs, indent=2))
        return
    for out in outs:
        _print(out)


if __name__ == "__main__":
    main()
