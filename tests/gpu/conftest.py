"""CUDA tests: collected everywhere (so they cannot rot on import), skipped without a CUDA device.

Run on a GPU machine with ``benchmarks/gpu_check.sh`` (docs/gpu.md). Each test runs one rank under
NCCL: several ranks cannot share one GPU under NCCL.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/") or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
