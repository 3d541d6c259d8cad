"""The checkpoint overhead table: save, async staging, verified load vs plain DCP, with floors, per storage class.

Runs ``benchmarks.checkpoint_save`` and ``benchmarks.checkpoint_load`` (each in its own process,
``--json``) for every storage class, size and world size asked for, and prints one markdown table
(and writes every figure, with the machine and the command, to ``--out``). The storage classes:

* ``disk``: a directory on the local disk (``--disk-dir``, default ``/var/tmp``), fsync real;
* ``shm``: ``/dev/shm`` (tmpfs): fsync free, so nothing hides the hash but idle cores;
* ``slow``: an ext4 file system on a loop device whose writes are throttled to ``--slow-mbps``
  MB/s by the blkio cgroup (needs root, ``losetup``, ``mkfs.ext4`` and cgroup v1's blkio
  controller; created for the run and removed after it). Where that cannot be made, the
  class is skipped, and the table says why.

The floors are :mod:`benchmarks.floors`' (plain's time; plain's CPU work plus one SHA-256 pass
spread over the rank's cores; the hash on the threads that can run it at once); the durable floor
adds the per-save fixed work a lineage save cannot skip, measured in the same run (the manifest
made durable; at W>1 one round trip of the process group), and a load's verification floor adds
the fixed work verification adds to a load (rank 0 reads and hashes the manifest; at W>1 one round
trip), measured in the same run. The async
column is at W=1 only (blocking time per save: staging, against ``dcp.async_save``'s). Each
class is calibrated afresh at its first cell (``--recalibrate``), so a cached probe from a busy
moment does not decide a quiet run.

    python -m benchmarks.checkpoint_matrix --out /tmp/checkpoint-matrix.json      # ~10 min on 2 idle cores
    python -m benchmarks.checkpoint_matrix --classes shm --sizes 12 --worlds 1 --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.floors import verification_floor_s
from shardline.checkpoint.coordination.parallelism import available_cores

REPS = {12: (16, 6), 192: (10, 4), 1024: (8, 2)}  # size in MiB -> (save reps, load reps); others: (6, 4)
BLKIO = Path("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device")


def _run(module: str, *args: str) -> dict[str, Any] | list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--json"], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(("{", "[")))  # after anything else printed
    return json.loads("\n".join(lines[first:]))


@contextlib.contextmanager
def _slow_device(under: Path, mbps: int, size_gib: int) -> Iterator[Path]:
    """An ext4 file system on a loop device (image in ``under``) with writes throttled to ``mbps`` MB/s."""
    if os.geteuid() != 0:
        raise RuntimeError("needs root (a loop device and the blkio throttle)")
    if not BLKIO.exists():
        raise RuntimeError(f"no cgroup v1 blkio throttle ({BLKIO})")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed")
    image = Path(tempfile.mkstemp(prefix="shardline-slow-", suffix=".img", dir=under)[1])
    mount = Path(tempfile.mkdtemp(prefix="shardline-slow-mnt-", dir=under))
    loop = majmin = None
    try:
        os.truncate(image, size_gib << 30)
        loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True)
        device = loop.stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", device], check=True)
        subprocess.run(["mount", device, str(mount)], check=True)
        majmin = Path(f"/sys/block/{Path(device).name}/dev").read_text().strip()
        BLKIO.write_text(f"{majmin} {mbps * 10**6}\n")
        yield mount
    finally:
        if majmin is not None:
            with contextlib.suppress(OSError):
                BLKIO.write_text(f"{majmin} 0\n")
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)
        if loop is not None:
            subprocess.run(["losetup", "-d", loop.stdout.strip()], check=False, capture_output=True)
        image.unlink(missing_ok=True)
        shutil.rmtree(mount, ignore_errors=True)


def _cell(where: Path, mib: int, world: int, quick: bool, first: bool) -> dict[str, Any]:
    save_reps, load_reps = REPS.get(mib, (6, 4))
    if quick:
        save_reps, load_reps = max(3, save_reps // 2), max(2, load_reps // 2)
    args = ["--mib", str(mib), "--reps", str(save_reps), "--world", str(world), "--dir", str(where)]
    save = _run(
        "benchmarks.checkpoint_save", *args, *(["--no-async"] if world > 1 else []), *(["--recalibrate"] * first)
    )
    assert isinstance(save, dict)
    loads = _run(
        "benchmarks.checkpoint_load", "--mib", str(mib), "--reps", str(load_reps), "--world", str(world),
        "--cache", "hot", "--dir", str(where),
    )  # fmt: skip
    assert isinstance(loads, list)
    load = loads[0]
    cores = max(1, available_cores() // world)
    files = int(load["files"]) // world
    hash_one = float(load["sha256_of_one_rank_share_s"])
    plain = float(load["plain_dcp_load_s"])
    load_floor = max(plain, (float(load["plain_cpu_s_rank0"]) + hash_one) / cores, hash_one / max(1, min(files, cores)))
    load["floor_s"] = load_floor
    load["verified_over_floor"] = float(load["shardline_verified_load_s"]) / load_floor
    verification = verification_floor_s(floor=load_floor, fixed=float(load["verification_fixed_s"]))
    load["verification_floor_s"] = verification
    load["verified_over_verification_floor"] = float(load["shardline_verified_load_s"]) / verification
    return {"mib": mib, "world": world, "save": save, "load": load}


def _row(storage: str, cell: dict[str, Any]) -> str:
    s, ld = cell["save"], cell["load"]
    ms = lambda x: f"{float(x) * 1e3:.0f}"  # noqa: E731
    lo, hi = s["paired_ratio_median_95ci"]
    flo, fhi = s["over_floor_median_95ci"]
    dlo, dhi = s["over_durable_floor_median_95ci"]
    staging = (
        f"{ms(s['async_blocking_plain_s'])} / {ms(s['async_blocking_shardline_s'])} / {ms(s['async_blocking_floor_s'])}"
        if "async_blocking_plain_s" in s
        else "--"
    )
    tuning = s["tuning"]
    how = ("during writes" if tuning["hash_during_writes"] else "from fsync") + (
        f", wb {tuning['writeback_every'] >> 20} MiB" if tuning["writeback_every"] else ", no wb"
    )
    return (
        f"| {storage} | {cell['mib']} | {cell['world']} | {ms(s['plain_dcp_save_s'])} | {ms(s['shardline_save_s'])} | "
        f"{ms(s['sha256_one_thread_s'])} / {ms(s['sha256_parallel_s'])} | {ms(s['floor_s'])} "
        f"({'plain' if s['floor_is_plain'] else 'CPU/hash'}) | {ms(s['durable_floor_s'])} | "
        f"**{s['paired_ratio_median']:.3f}x** ({lo:.2f}-{hi:.2f}) | "
        f"{s['over_floor_median']:.3f}x ({flo:.2f}-{fhi:.2f}) | "
        f"{s['over_durable_floor_median']:.3f}x ({dlo:.2f}-{dhi:.2f}) | {'yes' if s['target_met'] else 'no'} | {how} | "
        f"{staging} | {ms(ld['plain_dcp_load_s'])} / {ms(ld['shardline_verified_load_s'])} / {ms(ld['floor_s'])} | "
        f"{ld['verified_over_plain']:.2f}x / {ld['verified_over_floor']:.2f}x | "
        f"{ms(ld['verification_floor_s'])} ({ld['verified_over_verification_floor']:.2f}x) |"
    )


HEADER = (
    "| storage | state MiB | W | plain save ms | shardline ms | SHA-256 ms, 1 thread / rank's threads | floor ms "
    "| durable floor ms | shardline / plain (95%) | shardline / floor (95%) | shardline / durable floor (95%) "
    "| target met | calibration | async blocking ms, plain / shardline / floor | load ms: plain / verified / floor "
    "| verified / plain, / floor | load verification floor ms (verified / it) |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"
)


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "commit": commit.stdout.strip() or None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_at_start": os.getloadavg(),
        "command": " ".join(["python -m benchmarks.checkpoint_matrix", *sys.argv[1:]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="disk,shm,slow", help="storage classes, comma-separated")
    parser.add_argument(
        "--sizes", default="12,192,1024", help="MiB per rank... (the state dict's size), comma-separated"
    )
    parser.add_argument("--worlds", default="1,2", help="world sizes, comma-separated")
    parser.add_argument("--disk-dir", default="/var/tmp", help="a directory on the local disk")
    parser.add_argument("--slow-mbps", type=int, default=400, help="the slow device's write throttle, MB/s")
    parser.add_argument("--quick", action="store_true", help="half the reps (a smoke run; wide intervals)")
    parser.add_argument("--out", default=None, help="write every figure, the machine and the command here (JSON)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    machine = _machine()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, kernel {machine['kernel']}, torch {machine['torch']}, "
        f"commit {machine['commit']}, {machine['date']}, load average {machine['load_average_at_start'][0]:.1f}"
    )
    print(f"command: {machine['command']}\n")
    print(HEADER, flush=True)
    results: dict[str, Any] = {"machine": machine, "cells": [], "skipped": {}}
    for storage in args.classes.split(","):
        try:
            with contextlib.ExitStack() as stack:
                if storage == "disk":
                    where = Path(tempfile.mkdtemp(prefix="shardline-matrix-", dir=args.disk_dir))
                    stack.callback(shutil.rmtree, where, True)
                elif storage == "shm":
                    where = Path(tempfile.mkdtemp(prefix="shardline-matrix-", dir="/dev/shm"))
                    stack.callback(shutil.rmtree, where, True)
                elif storage == "slow":
                    # A sparse image: room for a rep's saves, the async part's (up to 6 kept by its manager) and
                    # the probes, at the largest size; it costs disk space only as it is written.
                    size_gib = max(4, 10 * max(sizes) // 1024 + 2)
                    where = stack.enter_context(_slow_device(Path(args.disk_dir), args.slow_mbps, size_gib))
                else:
                    raise RuntimeError(f"unknown storage class {storage!r} (disk, shm, slow)")
                label = f"slow ({args.slow_mbps} MB/s loop)" if storage == "slow" else storage
                first = True
                for mib in sizes:
                    for world in worlds:
                        cell = _cell(where, mib, world, args.quick, first)
                        first = False
                        cell["storage"] = label
                        results["cells"].append(cell)
                        print(_row(label, cell), flush=True)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            results["skipped"][storage] = str(e)
            print(f"| {storage} | skipped: {str(e).splitlines()[0]} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"\nevery figure: {args.out}")


if __name__ == "__main__":
    main()
