#!/usr/bin/env bash
# The GPU acceptance kit (docs/gpu.md): on a machine with one NVIDIA GPU, in one command and under
# 8 minutes, run the CUDA tests at W=1 with NCCL (tests/gpu) and the ~1B Llama-shaped benchmark
# (shardline FULL_SHARD vs torch FSDP2 vs the plain model, bf16), and write the results, with the
# device's name, to OUT_DIR (default: gpu_results/).
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#
# Exit status: 0 when every GPU test passed (the benchmark's targets are reported, MET or MISSED,
# in OUT_DIR/results.md); 1 when a test or the benchmark failed; 2 when there is no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${1:-gpu_results}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device: torch.cuda.is_available() is False on $(hostname) (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null))." >&2
    echo "gpu_check: nothing was run. Run this on a machine with an NVIDIA GPU and a CUDA build of torch (docs/gpu.md)." >&2
    exit 2
fi

mkdir -p "$OUT"
DEVICE="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
echo "gpu_check: $DEVICE; writing $OUT/"
status=0

echo "== 1/2 CUDA tests at W=1 with NCCL (tests/gpu) =="
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2/2 ~1B Llama-shaped decoder, bf16: shardline FULL_SHARD vs torch FSDP2 vs the plain model =="
timeout 240 "$PY" -m benchmarks.gpu_bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

{
    echo "# shardline GPU check"
    echo
    echo "- device: $DEVICE"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- torch: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
    echo
    echo "## CUDA tests (tests/gpu, W=1, NCCL)"
    echo
    echo '```'
    tail -n 15 "$OUT/gpu_tests.txt"
    echo '```'
    echo
    echo "## Benchmark"
    echo
    cat "$OUT/bench.txt"
} > "$OUT/results.md"
echo "gpu_check: results in $OUT/results.md (exit $status)"
exit "$status"
