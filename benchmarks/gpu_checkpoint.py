"""Checkpoints of the ~1.1B model on one GPU: the async save's blocking time and the verified load's, vs plain DCP.

Part of the GPU acceptance kit (``benchmarks/gpu_check.sh``, docs/gpu.md). The state: the
benchmark's shardline FULL_SHARD model (``benchmarks/gpu_bench.py``, fp32 masters on the device)
after one fused-AdamW step, so weights and both moments (about 13 GB at 1.1B parameters), saved
to the local disk (``--dir``, default a temporary folder) and deleted afterwards.

Async save, each round (the order alternates from round to round), from the same model:

- shardline: ``CheckpointManager(async_save=True).save(SaveRequest(...))`` returns once the state
  is staged into the manager's pinned host buffers, reused from save to save; then the write,
  hashing and commit run in the background (``manager.wait()``);
- plain DCP: ``dcp.async_save`` of a state dict built from the model by the same functions
  (inside the timed region, as shardline builds its own) through a ``FileSystemWriter`` with as
  many threads as shardline writes files, on the default group (``cpu:gloo,cuda:nccl``: async
  DCP needs a CPU backend). The writer stages: host copies allocated per save, and, on CUDA,
  with ``cache_staged_state_dict=True``, pinned copies reused from save to save.

Blocking: from the call until it returns (the training loop waits that long); total: until
the checkpoint is written. Rounds after the first reuse what the first allocated.

Load (after the first round, the files in the page cache): plain ``dcp.load`` into the live
model's and optimizer's state dicts (checks nothing) vs ``shardline.checkpoint.load``
(``verify="full"``: every byte hashed against the manifest while reading), alternating.

Targets: the async save blocks no longer than DCP's async_save with copies allocated per save
(last round); the verified load within 1.3x plain DCP's from the page cache (the CPU benchmark's target,
``benchmarks/checkpoint_load.py``). ``--out`` is rewritten after each phase.

    python -m benchmarks.gpu_checkpoint --out gpu_results/checkpoint.json [--rounds 2] [--budget-s 100]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardline
import shardline.checkpoint as ckpt
from benchmarks.gpu_bench import Shape, build, tokens, train_step
from shardline.checkpoint.coordination.parallelism import resolve_files_per_rank
from shardline.distributed import init_distributed

LOAD_TARGET = 1.3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_state(shape: Shape, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The benchmark's shardline model after one optimizer step (so the optimizer has its moments)."""
    model, opt, _ = build("shardline", shape, device)
    x, y = tokens(shape, device, batch=1)
    train_step(model, opt, x, y, autocast=False)
    _sync(device)
    return model, opt


class Savers:
    """The three async saves of one model, each timed: (blocking seconds, total seconds)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, root: Path, *, files: int) -> None:
        self.model, self.opt, self.root, self.files = model, opt, root, files
        self.device = next(model.parameters()).device
        self.manager = ckpt.CheckpointManager(root / "shardline", async_save=True, keep_last_n=1, files_per_rank=files)
        self.step = 0
        # Note: each DCP writer stages the state itself (``FileSystemWriter`` is DCP's blocking stager), as when
        # async_save is given a writer. Without one, async_save stages through ``DefaultStager``, which fails on
        # DTensors whose local tensors are views of one storage (torch 2.11 and 2.13: "Attempted to call copy_()
        # on an invalid python storage"), as shardline's shards of one flat buffer are.
        self.writers = {"dcp": dcp.FileSystemWriter(root / "dcp", thread_count=files)}
        if self.device.type == "cuda":  # host copies pinned and reused from save to save, as shardline's are
            self.writers["dcp_cached"] = dcp.FileSystemWriter(
                root / "dcp_cached", thread_count=files, cache_staged_state_dict=True
            )

    def kinds(self) -> tuple[str, ...]:
        """The saves this device runs (pinning host memory needs CUDA)."""
        return ("shardline", *self.writers)

    def run(self, kind: str) -> tuple[float, float]:
        """One save of ``kind``: (blocking, total) seconds."""
        _sync(self.device)
        if kind == "shardline":
            self.manager.wait()  # nothing pending: each save is waited for below
            self.step += 1
            start = time.perf_counter()
            self.manager.save(ckpt.SaveRequest(model=self.model, optimizer=self.opt, step=self.step))
            blocked = time.perf_counter() - start
            self.manager.wait()
            return blocked, time.perf_counter() - start
        target = self.root / f"{kind}-{self.step}"
        start = time.perf_counter()
        state = {"model": ckpt.model_state_dict(self.model), "optim": ckpt.optimizer_state_dict(self.model, self.opt)}
        pending = dcp.async_save(state, checkpoint_id=target, storage_writer=self.writers[kind])
        blocked = time.perf_counter() - start
        getattr(pending, "upload_completion", pending).result()
        total = time.perf_counter() - start
        shutil.rmtree(target)
        return blocked, total

    def latest(self) -> Path:
        """shardline's newest committed checkpoint."""
        path = self.manager.latest()
        if path is None:
            raise RuntimeError(f"no committed shardline checkpoint under {self.root / 'shardline'}")
        return Path(path)

    def close(self) -> None:
        """Wait for and release everything (the manager's pinned buffers, the DCP writers' cached copies)."""
        self.manager.close()
        self.writers.clear()


def time_loads(model: nn.Module, opt: torch.optim.Optimizer, path: Path, *, reps: int) -> dict[str, list[float]]:
    """Plain ``dcp.load`` and shardline's verified load of ``path`` into the live model, alternating."""
    device = next(model.parameters()).device

    def plain() -> None:
        state = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)

    def verified() -> None:
        ckpt.load(path, model=model, optimizer=opt)

    loads: list[tuple[str, Callable[[], None]]] = [("plain_dcp", plain), ("shardline_verified", verified)]
    runs: dict[str, list[float]] = {name: [] for name, _ in loads}
    for i in range(reps):
        for name, fn in loads if i % 2 == 0 else loads[::-1]:
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            runs[name].append(time.perf_counter() - start)
    return runs


def summarize(saves: dict[str, dict[str, list[float]]], loads: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """The targets: the last round's blocking times, the loads' medians; ``met`` None where a side is missing."""
    ours, dcp_default = (saves.get(k, {}).get("blocking_s") for k in ("shardline", "dcp"))
    plain, verified = loads.get("plain_dcp"), loads.get("shardline_verified")
    ratio = statistics.median(verified) / statistics.median(plain) if plain and verified else None
    return {
        "async save blocks <= DCP async_save's": {
            "shardline_s": ours[-1] if ours else None,
            "dcp_s": dcp_default[-1] if dcp_default else None,
            "met": ours[-1] <= dcp_default[-1] if ours and dcp_default else None,
        },
        f"verified load <= {LOAD_TARGET}x plain DCP load (page cache)": {
            "shardline_verified_s": statistics.median(verified) if verified else None,
            "plain_dcp_s": statistics.median(plain) if plain else None,
            "ratio": ratio,
            "met": None if ratio is None else ratio <= LOAD_TARGET,
        },
    }


def table(
    saves: dict[str, dict[str, list[float]]], loads: dict[str, list[float]], failed: dict[str, str] | None = None
) -> str:
    """Markdown tables of the saves (each round) and the loads (median); a row for each failed one."""
    names = {
        "shardline": "shardline CheckpointManager(async_save=True)",
        "dcp": "DCP async_save, FileSystemWriter",
        "dcp_cached": "DCP async_save, FileSystemWriter(cache_staged_state_dict=True)",
    }
    lines = ["| async save | blocking (s), each round | until written (s), each round |", "|---|---:|---:|"]
    for kind, runs in saves.items():
        blocking = " / ".join(f"{s:.2f}" for s in runs["blocking_s"])
        total = " / ".join(f"{s:.2f}" for s in runs["total_s"])
        lines.append(f"| {names[kind]} | {blocking} | {total} |")
    failed = failed or {}
    lines += [f"| {names[k]} | FAILED: {e.splitlines()[-1][:160]} | |" for k, e in failed.items() if k in names]
    lines += ["", "| load (page cache) | median (s) | runs (s) |", "|---|---:|---:|"]
    for name, label in (("plain_dcp", "plain dcp.load"), ("shardline_verified", 'shardline load(verify="full")')):
        if loads.get(name):
            runs = ", ".join(f"{s:.2f}" for s in loads[name])
            lines.append(f"| {label} | {statistics.median(loads[name]):.2f} | {runs} |")
    if "load" in failed:
        lines.append(f"| loads | FAILED: {failed['load'].splitlines()[-1][:160]} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the checkpoint benchmark; write ``--out`` after each phase; print the tables and the verdicts.

    Exit 0; 1 when a save or load failed (the others are reported) or nothing could run (not enough disk); 2
    without a device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON) to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the kit's own smoke test")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=2, help="save rounds (each: one save of every kind)")
    parser.add_argument("--load-reps", type=int, default=2, help="loads of each kind")
    parser.add_argument("--budget-s", type=float, default=0, help="start no save round that would end later (0: any)")
    for field, default in asdict(Shape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default, help=f"model shape: {field}")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_checkpoint: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")
    began = time.perf_counter()
    shape = Shape(**{f: getattr(args, f) for f in asdict(Shape())})
    info = init_distributed(backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    device = info.device if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    model, opt = model_state(shape, device)
    state_bytes = sum(
        t.numel() * t.element_size()
        for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    )
    root = Path(tempfile.mkdtemp(prefix="shardline-gpu-ckpt-", dir=args.dir))
    files = resolve_files_per_rank(0)
    report: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "shardline": shardline.__version__,
        "shape": asdict(shape),
        "state_bytes": state_bytes,
        "files_per_rank": files,
        "dir": str(root),
        "free_bytes": shutil.disk_usage(root).free,
        "async_save": {},
        "load": {},
        "failed": {},
        "skipped": [],
    }

    def write() -> None:
        report["targets"] = summarize(report["async_save"], report["load"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    # Note: two checkpoints at once at most: shardline's last (kept for the loads) and the one being written.
    if report["free_bytes"] < 2.1 * state_bytes:
        report["skipped"].append(f"not enough disk at {root}: {report['free_bytes']:,} B free, 2.1 x {state_bytes:,}")
        write()
        shutil.rmtree(root)
        print(f"gpu_checkpoint: {report['skipped'][-1]}; use --dir on a larger disk", file=sys.stderr)
        return 1
    print(f"device: {name}; state: {state_bytes / 2**30:.1f} GiB (weights + AdamW moments); {files} files", flush=True)
    savers = Savers(model, opt, root, files=files)
    try:
        deadline = began + args.budget_s if args.budget_s > 0 else math.inf
        _rounds(savers, report, rounds=args.rounds, load_reps=args.load_reps, deadline=deadline, write=write)
    finally:
        savers.close()
        shutil.rmtree(root, ignore_errors=True)
    write()
    print(table(report["async_save"], report["load"], report["failed"]) + "\n")
    for target, verdict in report["targets"].items():
        status = {True: "MET", False: "MISSED", None: "UNKNOWN"}[verdict["met"]]
        print(f"- {status} {target}: {verdict}")
    for skipped in report["skipped"]:
        print(f"- skipped: {skipped}")
    return 1 if report["failed"] else 0


def _rounds(
    savers: Savers, report: dict[str, Any], *, rounds: int, load_reps: int, deadline: float, write: Callable[[], None]
) -> None:
    """The save rounds, and the loads after the first; a save or load that fails is recorded and not run again."""
    failed: dict[str, str] = report["failed"]
    round_s = 0.0
    for i in range(rounds):
        if i and time.perf_counter() + round_s > deadline:
            report["skipped"].append(f"save rounds {i + 1}-{rounds}: they would end after --budget-s")
            break
        start = time.perf_counter()
        for kind in savers.kinds() if i % 2 == 0 else savers.kinds()[::-1]:
            if kind in failed:
                continue
            try:
                blocked, total = savers.run(kind)
            except Exception as exc:  # recorded; the other saves still run
                failed[kind] = f"{type(exc).__name__}: {exc}"
                print(f"gpu_checkpoint: {kind} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                write()
                continue
            runs = report["async_save"].setdefault(kind, {"blocking_s": [], "total_s": []})
            runs["blocking_s"].append(blocked)
            runs["total_s"].append(total)
            print(f"  round {i + 1}: {kind}: blocked {blocked:.2f} s, written in {total:.2f} s", flush=True)
            write()
        round_s = time.perf_counter() - start
        if i == 0 and "shardline" not in failed:  # the loads right after the first round: they matter most
            try:
                path = savers.latest()
                report["checkpoint_bytes"] = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                report["load"] = time_loads(savers.model, savers.opt, path, reps=load_reps)
            except Exception as exc:
                failed["load"] = f"{type(exc).__name__}: {exc}"
                print(f"gpu_checkpoint: the loads failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            write()


if __name__ == "__main__":
    sys.exit(main())
