"""Benchmark on one GPU: shardline FULL_SHARD (eager and compiled) vs torch FSDP2 vs the plain model, ~1B, bf16.

Part of the GPU acceptance kit (``benchmarks/gpu_check.sh``, docs/gpu.md). The model is built from
a ``LlamaConfig`` (TinyLlama-1.1B's shape: 22 layers, hidden 2048, MLP 5632, 32 heads, 4 KV heads,
vocabulary 32000) with random weights -- nothing is downloaded. All keep fp32 master weights,
compute in bf16 and reduce in fp32: shardline ``MixedPrecision(param_dtype=bf16,
reduce_dtype=fp32)``, FSDP2 ``MixedPrecisionPolicy`` with the same dtypes, the plain model under
``torch.autocast(bf16)``; each with ``AdamW(fused=True)``, one unit per decoder layer plus the
root. ``shardline+compile`` is shardline's with each decoder layer compiled (``layer.compile()``,
what ``trainer.compile=true`` does to this model: ``shardline.train.compiling.compile_units``).

Measured per configuration, after ``--warmup`` steps (the first one, compilation included, is
reported too), over ``--steps`` steps between two ``torch.cuda.synchronize()``: step time,
tokens/s, MFU (model FLOPs per token ``6N + 12 L h T``, PaLM's count, over the device's dense
bf16 peak when known), and ``max_memory_allocated`` over the measured steps. The targets:
shardline's step time and peak memory at most FSDP2's, and at most 3% slower than the plain
model (one rank: nothing to communicate). A configuration that fails is reported with its error
and the others still run; ``--out`` is rewritten after each one.

    python -m benchmarks.gpu_bench --out gpu_results/bench.json

``--device cpu`` with a small shape runs the same code on gloo (the kit's own test, on CPU;
``--compile-backend aot_eager`` there, where inductor would spend a minute compiling C++).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardline
from shardline.distributed import init_distributed
from shardline.models.hf import tiny_llama

# Dense bf16 peak FLOP/s by device name (vendor data sheets); MFU is "n/a" for other devices.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,  # SXM
    "A100": 312.0e12,
    "L40S": 362.05e12,
    "L4": 121.0e12,
}
CONFIGS = ("plain", "fsdp2", "shardline", "shardline+compile")
OVERHEAD_TARGET = 0.03


@dataclass(frozen=True)
class Shape:
    """The decoder's shape (defaults: TinyLlama-1.1B)."""

    layers: int = 22
    hidden: int = 2048
    intermediate: int = 5632
    heads: int = 32
    kv_heads: int = 4
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4


@dataclass
class Result:
    """One configuration's measurements."""

    config: str
    parameters: int
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    max_memory_allocated_mib: float | None  # None off CUDA
    final_loss: float
    first_step_s: float  # the first warm-up step: CUDA/NCCL start-up, and compilation where compiled


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device named ``device_name``, or None when unknown."""
    for key, value in PEAK_BF16_FLOPS.items():  # longest names first where they overlap ("H100 PCIe")
        if key in device_name:
            return value
    return None


def flops_per_token(n_params: int, shape: Shape) -> float:
    """Training FLOPs per token: ``6N`` for the matmuls, ``12 L h T`` for attention (PaLM, appendix B)."""
    return 6.0 * n_params + 12.0 * shape.layers * shape.hidden * shape.seq


def build(
    config: str, shape: Shape, device: torch.device, *, compile_backend: str = "inductor", offload: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The model for ``config`` on ``device``, sharded as that configuration does, its optimizer, its size.

    ``offload``: shardline's units keep shards, gradients and optimizer state in host memory
    (``benchmarks/gpu_offload.py``).
    """
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")
    torch.manual_seed(0)
    with torch.device(device):
        model = tiny_llama(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            max_position_embeddings=shape.seq,
            tie_word_embeddings=False,
        )
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    layers = list(model.model.layers)
    if config.startswith("shardline"):
        mp = shardline.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        cpu = shardline.CPUOffload() if offload else None
        shardline.wrap(model, lambda m: any(m is layer for layer in layers), mixed_precision=mp, offload=cpu)
        if config == "shardline+compile":
            # Note: the units below the root are the decoder layers, so this is what
            # ``compile_units`` (trainer.compile=true) compiles; the kit's CPU test checks that.
            # Named here for ``compile_backend``: on CPU the test compiles with aot_eager.
            for layer in layers:
                layer.compile(backend=compile_backend)
    elif config == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), n_params


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, autocast: bool
) -> torch.Tensor:
    """One training step; the loss stays on the device. No KV cache: training does not use one, and with
    it every decoder layer would see a different cache state, so a compiled layer would recompile per layer."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x, use_cache=False).logits
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def tokens(shape: Shape, device: torch.device, *, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch (inputs, next-token targets) of ``shape``'s size on ``device``."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab, (batch or shape.batch, shape.seq + 1), generator=generator).to(device)
    return ids[:, :-1], ids[:, 1:]


def measure(
    config: str, shape: Shape, device: torch.device, *, warmup: int, steps: int, compile_backend: str = "inductor"
) -> Result:
    """Train ``warmup + steps`` steps of ``config``; time and measure the last ``steps``."""
    model, opt, n_params = build(config, shape, device, compile_backend=compile_backend)
    x, y = tokens(shape, device)
    autocast = config == "plain"
    _sync(device)
    start = time.perf_counter()
    loss = train_step(model, opt, x, y, autocast=autocast)
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        loss = train_step(model, opt, x, y, autocast=autocast)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model, opt, x, y, autocast=autocast)
    _sync(device)
    elapsed = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    tokens_per_s = shape.batch * shape.seq / elapsed
    flops = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    mfu = tokens_per_s * flops_per_token(n_params, shape) / flops if flops else None
    return Result(config, n_params, elapsed, tokens_per_s, mfu, peak, float(loss), first)


def _release(device: torch.device) -> None:
    """Free what a configuration left (a failed one too) before the next is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _at_most(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a <= b


def verdicts(results: dict[str, Result]) -> dict[str, dict[str, Any]]:
    """The kit's targets, each with the numbers compared and whether it is met (None: a side is missing)."""

    def get(config: str, field: str) -> Any:
        return getattr(results[config], field) if config in results else None

    ours, fsdp2, plain = (get(c, "step_time_s") for c in ("shardline", "fsdp2", "plain"))
    compiled = get("shardline+compile", "step_time_s")
    ours_mib, fsdp2_mib = get("shardline", "max_memory_allocated_mib"), get("fsdp2", "max_memory_allocated_mib")
    overhead = None if ours is None or plain is None else ours / plain - 1.0
    speedup = None if ours is None or compiled is None else ours / compiled
    return {
        "step time <= FSDP2's": {"shardline": ours, "fsdp2": fsdp2, "met": _at_most(ours, fsdp2)},
        "peak memory <= FSDP2's": {"shardline": ours_mib, "fsdp2": fsdp2_mib, "met": _at_most(ours_mib, fsdp2_mib)},
        f"overhead vs the plain model <= {OVERHEAD_TARGET:.0%}": {
            "overhead": overhead,
            "met": _at_most(overhead, OVERHEAD_TARGET),
        },
        "compiled step time <= eager's": {"speedup": speedup, "met": _at_most(compiled, ours)},
    }


def table(results: dict[str, Result], failed: dict[str, str] | None = None) -> str:
    """A Markdown table of the results (and a row per failed configuration)."""
    lines = [
        "| configuration | step time (s) | tokens/s | MFU | max_memory_allocated (MiB) | first step (s) | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        mfu = "n/a" if r.mfu is None else f"{r.mfu:.1%}"
        mem = "n/a" if r.max_memory_allocated_mib is None else f"{r.max_memory_allocated_mib:,.0f}"
        lines.append(
            f"| {r.config} | {r.step_time_s:.4f} | {r.tokens_per_s:,.0f} | {mfu} | {mem} | {r.first_step_s:.1f} "
            f"| {r.final_loss:.4f} |"
        )
    for config, error in (failed or {}).items():
        lines.append(f"| {config} | FAILED: {error.splitlines()[-1][:160]} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write ``--out`` (JSON, with the device name) and print a table and the verdicts.

    Exit 0, 1 when a configuration failed (the others are reported), 2 without a device."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results file (JSON) to write")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the kit's own smoke test")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (at least 1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of shardline+compile")
    for field, default in asdict(Shape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default, help=f"model shape: {field}")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in configs if c not in CONFIGS] or args.warmup < 1:
        parser.error(f"--configs must name some of {CONFIGS} (got {unknown}), --warmup at least 1 ({args.warmup})")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine", file=sys.stderr
        )
        return 2
    shape = Shape(**{f: getattr(args, f) for f in asdict(Shape())})
    info = init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    if info.world_size != 1:
        print(f"gpu_bench: runs on one rank; got {info.world_size} (do not launch it with torchrun)", file=sys.stderr)
        return 2
    device = info.device if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {name}; model: {shape}", flush=True)
    results: dict[str, Result] = {}
    failed: dict[str, str] = {}
    report: dict[str, Any] = {}
    for config in configs:
        try:
            results[config] = measure(
                config, shape, device, warmup=args.warmup, steps=args.steps, compile_backend=args.compile_backend
            )
            print(table({config: results[config]}).splitlines()[-1], flush=True)
        except Exception as exc:  # reported, and the other configurations still run
            failed[config] = f"{type(exc).__name__}: {exc}"
            print(f"gpu_bench: {config} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        _release(device)
        report = {
            "device": name,
            "torch": torch.__version__,
            "shardline": shardline.__version__,
            "shape": asdict(shape),
            "compile_backend": args.compile_backend,
            "parameters": next(iter(results.values())).parameters if results else None,
            "results": {k: asdict(v) for k, v in results.items()},
            "failed": failed,
            "targets": verdicts(results),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # after each: a timeout keeps what was measured
    params = f"{report['parameters'] / 1e9:.2f}B parameters" if report["parameters"] else "no configuration ran"
    print(f"device: {name}; model: {params}, {shape}\n")
    print(table(results, failed) + "\n")
    for target, verdict in report["targets"].items():
        status = {True: "MET", False: "MISSED", None: "UNKNOWN"}[verdict["met"]]
        print(f"- {status} {target}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
