"""Before the GPU kit touches the device: import everything its GPU path imports, and say where each package came from.

``benchmarks/gpu_check.sh`` runs this first, on any machine (so a CPU rehearsal of the kit,
``nox -s gpu_rehearsal``, proves the same imports work in an environment like the GPU image).
It imports the modules below -- the engine, checkpoints, the trainer (Hydra, omegaconf), the
Hugging Face Llama the benchmarks build, the benchmarks, the CUDA tests and what they import
inside their ranks -- composes the trainer's config (Hydra reads its YAML files at run time),
and prints each third-party package's version and origin: the image, the installed wheels
(``gpu_wheels/``) or this tree. Exit 0, or 3 with each failed import and how to fix it.

    PYTHONPATH=build/gpu_site:src:. python -m benchmarks.gpu_preflight
"""

from __future__ import annotations

import importlib
import shutil
import sys
import traceback
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_ENVIRONMENT = 3

# Note: the list is what the GPU path imports, top-level or lazily: modules the CUDA tests import
# inside their ranks (tests.train.test_host_sync) and the benchmarks import when they run
# (transformers' Llama) are named, since collecting tests/gpu does not reach them.
GPU_PATH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "shardline",
    "shardline.checkpoint",
    "shardline.testing",
    "shardline.train",
    "shardline.train.compiling",
    "shardline.models.hf",
    "transformers.models.llama.modeling_llama",
    "benchmarks.gpu_bench",
    "benchmarks.gpu_checkpoint",
    "benchmarks.gpu_offload",
    "tests.gpu.test_cuda",
    "tests.train.test_host_sync",
)
# import name -> distribution name
PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "rich": "rich",
    "yaml": "PyYAML",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime",
}


def origin(module: object, *, site: Path | None) -> str:
    """Where an imported module lives: the installed wheels (``site``), this tree, or the image/environment."""
    path = Path(getattr(module, "__file__", None) or "").resolve()
    if site is not None and path.is_relative_to(site.resolve()):
        return "gpu_wheels"
    if any(path.is_relative_to(ROOT / part) for part in ("src", "benchmarks", "tests")):
        return "this tree"
    return "environment"


def preflight(*, site: Path | None) -> list[str]:
    """Import the GPU path and compose the trainer's config; the problems found (none: ready)."""
    problems = []
    for name in GPU_PATH_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or "?"
            problems.append(
                f"importing {name} failed: {exc}. The GPU image lacks {missing!r}: if the GPU path needs it, add "
                f"its wheel to benchmarks/gpu_wheels.txt and rerun benchmarks/gpu_prepare.sh (or keep the import "
                f"off the GPU path); if it is listed there, the carried gpu_wheels/ is incomplete"
            )
        except Exception:
            problems.append(f"importing {name} failed:\n{traceback.format_exc()}")
    if problems:
        return problems
    import shardline
    from shardline.train.config import compose_config

    if not Path(shardline.__file__).resolve().is_relative_to(ROOT / "src"):
        problems.append(f"shardline was imported from {shardline.__file__}, not {ROOT / 'src'}: put src on PYTHONPATH")
    try:
        compose_config(["trainer.max_steps=1"])
    except Exception:
        problems.append(f"composing the trainer's config failed:\n{traceback.format_exc()}")
    return problems


def report(*, site: Path | None) -> str:
    """One line per package: version and origin; then the Python and the C compiler inductor's kernels need."""
    lines = [f"python {sys.version.split()[0]} ({sys.executable})"]
    for name, distribution in PACKAGES.items():
        module = sys.modules.get(name) or importlib.import_module(name)
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:  # unpacked without its metadata
            version = getattr(module, "__version__", None) or "?"
        lines.append(f"{name:<13} {version:<22} {origin(module, site=site):<12} {Path(module.__file__).parent}")
    compiler = shutil.which("cc") or shutil.which("gcc")
    lines.append(f"C compiler    {compiler or 'none on PATH (torch.compile on CUDA needs one for Triton)'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the preflight; print the report, or the problems and exit 3."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=None, help="where gpu_wheels/ was installed (for the report)")
    args = parser.parse_args(argv)
    problems = preflight(site=args.site)
    if problems:
        for problem in problems:
            print(f"gpu_preflight: {problem}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    print(report(site=args.site))
    print(f"gpu_preflight: the GPU path imports ({len(GPU_PATH_MODULES)} modules) and the trainer's config compose")
    return 0


if __name__ == "__main__":
    sys.exit(main())
