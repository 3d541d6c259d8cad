"""CPU offload on one GPU: the device memory it saves and what it costs per step, against the same model without it.

Part of the GPU acceptance kit (``benchmarks/gpu_check.sh``, docs/gpu.md). A Llama-shaped decoder
(``gpu_bench.Shape`` with 8 layers by default: about 0.5B parameters) sharded as ``gpu_bench``
shards it (one unit per decoder layer plus the root, bf16 compute, fp32 masters, fused AdamW),
once as is and once with ``fully_shard(..., offload=CPUOffload())``: shards, gradients and AdamW
state in pinned host memory, the optimizer stepping on the host. Per configuration, after
``--warmup`` steps: step time over ``--steps`` steps, ``max_memory_allocated`` over them,
``memory_allocated`` between steps (what stays on the device), ``memory_stats``' host bytes and
the host <-> device bytes per step; and the losses of every step, whose largest difference
between the two is reported (on a GPU the host AdamW is another kernel than the device one, so
this is a measured difference, not a bit-for-bit claim). The target: the device memory held
between steps drops by at least 90% of what offload moved to the host.

    python -m benchmarks.gpu_offload --out gpu_results/offload.json

``--device cpu`` with a small shape runs the same code on gloo (the kit's own test).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import shardline
from benchmarks.gpu_bench import Shape, _release, _sync, build, tokens, train_step
from shardline.distributed import init_distributed
from shardline.engine import subtree_units, transfer_stats

CONFIGS = ("shardline", "shardline+offload")
SAVED_TARGET = 0.9


@dataclass
class Result:
    """One configuration's measurements (MiB: ``2**20`` bytes; ``None`` where the device is not CUDA)."""

    config: str
    step_time_s: float
    peak_device_mib: float | None
    between_steps_device_mib: float | None
    host_mib: float
    host_to_device_mib_per_step: float
    device_to_host_mib_per_step: float
    losses: list[float]
    host_pinned: bool | None  # every offloaded master buffer in page-locked memory (None: nothing offloaded)


def measure(config: str, shape: Shape, device: torch.device, *, warmup: int, steps: int) -> Result:
    """Train ``warmup + steps`` steps of ``config``; time and measure the last ``steps``."""
    model, opt, _ = build("shardline", shape, device, offload=config == "shardline+offload")
    x, y = tokens(shape, device)
    losses = [float(train_step(model, opt, x, y, autocast=False)) for _ in range(warmup)]
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = transfer_stats(model)
    h2d, d2h = before.host_to_device_bytes, before.device_to_host_bytes
    start = time.perf_counter()
    kept = [train_step(model, opt, x, y, autocast=False) for _ in range(steps)]
    _sync(device)
    elapsed = (time.perf_counter() - start) / steps
    losses += [float(loss) for loss in kept]
    after = transfer_stats(model)
    cuda = device.type == "cuda"
    stats = shardline.memory_stats(model, optimizer=opt)
    units = subtree_units(model)
    assert all(u.offload is not None for u in units) == (config == "shardline+offload")
    masters = [g.master for u in units if u.offload is not None for g in u.groups]
    return Result(
        config=config,
        step_time_s=elapsed,
        peak_device_mib=torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        between_steps_device_mib=torch.cuda.memory_allocated(device) / 2**20 if cuda else None,
        host_mib=stats.host_total / 2**20,
        host_to_device_mib_per_step=(after.host_to_device_bytes - h2d) / steps / 2**20,
        device_to_host_mib_per_step=(after.device_to_host_bytes - d2h) / steps / 2**20,
        losses=losses,
        host_pinned=all(m.is_pinned() for m in masters) if masters else None,
    )


def verdicts(results: dict[str, Result]) -> dict[str, Any]:
    """Memory saved, step-time cost, loss difference, and the target (None where not measurable)."""
    plain, off = results.get("shardline"), results.get("shardline+offload")
    if plain is None or off is None:
        return {}
    saved = (
        plain.between_steps_device_mib - off.between_steps_device_mib
        if plain.between_steps_device_mib is not None and off.between_steps_device_mib is not None
        else None
    )
    return {
        "device_mib_saved_between_steps": saved,
        "peak_device_mib_saved": (
            plain.peak_device_mib - off.peak_device_mib
            if plain.peak_device_mib is not None and off.peak_device_mib is not None
            else None
        ),
        "step_time_ratio": off.step_time_s / plain.step_time_s,
        "max_loss_difference": max(abs(a - b) for a, b in zip(plain.losses, off.losses, strict=True)),
        "host_buffers_pinned": off.host_pinned,
        "target": {
            "what": f"device memory between steps drops by >= {SAVED_TARGET:.0%} of the bytes moved to the host",
            "met": None if saved is None else saved >= SAVED_TARGET * off.host_mib,
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Run both configurations; write ``--out`` (JSON) and print a table. Exit 0, 1 on a failure, 2 without a device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON) to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the kit's own smoke test")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    defaults = {**asdict(Shape()), "layers": 8, "seq": 1024, "batch": 2}
    for field, default in defaults.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default, help=f"model shape: {field}")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_offload: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    shape = Shape(**{f: getattr(args, f) for f in defaults})
    info = init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    device = info.device if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {name}; model: {shape}", flush=True)
    results: dict[str, Result] = {}
    failed: dict[str, str] = {}
    for config in CONFIGS:
        try:
            results[config] = measure(config, shape, device, warmup=max(1, args.warmup), steps=args.steps)
        except Exception as exc:  # reported; the other configuration still runs
            failed[config] = f"{type(exc).__name__}: {exc}"
            print(f"gpu_offload: {config} failed: {failed[config]}", file=sys.stderr, flush=True)
        _release(device)
        report = {
            "device": name,
            "torch": torch.__version__,
            "shape": asdict(shape),
            "results": {k: asdict(v) for k, v in results.items()},
            "failed": failed,
            "verdicts": verdicts(results),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| config | step time (s) | peak device MiB | device MiB between steps | host MiB | H2D MiB/step |")
    print("|---|---|---|---|---|---|")
    for r in results.values():
        print(
            f"| {r.config} | {r.step_time_s:.3f} | {r.peak_device_mib} | {r.between_steps_device_mib} | "
            f"{r.host_mib:.1f} | {r.host_to_device_mib_per_step:.1f} |"
        )
    for key, value in report["verdicts"].items():
        print(f"- {key}: {value}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
