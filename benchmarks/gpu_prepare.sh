#!/usr/bin/env bash
# Step 1 of the GPU run (docs/gpu.md), here, with network: download into gpu_wheels/ (git-ignored)
# the wheels the GPU kit needs that the GPU machine's image lacks (benchmarks/gpu_wheels.txt), for
# CPython 3.12 on manylinux x86-64, and check the folder: every wheel there, each for that Python
# and platform, nothing else, under the 64 MiB one run carries. The remote run carries gpu_wheels/;
# benchmarks/gpu_check.sh installs it there without network.
#
#   benchmarks/gpu_prepare.sh [DEST]      (default: gpu_wheels; PYTHON=... to choose the Python that runs pip)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_wheels prepare --dest "${1:-gpu_wheels}"
