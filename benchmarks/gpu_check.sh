#!/usr/bin/env bash
# The GPU acceptance kit (docs/gpu.md): on a machine with one NVIDIA GPU, in one command and under
# 8 minutes, run the CUDA tests at W=1 with NCCL (tests/gpu), the ~1.1B Llama-shaped benchmark
# (shardline FULL_SHARD, eager and compiled, vs torch FSDP2 vs the plain model, bf16), CPU offload's
# device memory saved and step-time cost (a smaller decoder), and the big model's checkpoints
# (async save's blocking time, verified load's time, vs plain DCP), and write the
# results, named after the device, to OUT_DIR (default: gpu_results/).
#
#   benchmarks/gpu_check.sh [OUT_DIR]
#
# Python: $PYTHON, else .venv/bin/python, else python3 (the GPU image's: its torch is used as it
# is; nothing installs torch). When gpu_wheels/ is here (benchmarks/gpu_prepare.sh made it), its
# wheels are installed without network into build/gpu_site (pip install --no-index --no-deps
# --target). PYTHONPATH=build/gpu_site:src:. -- no editable install. Before touching the device it
# imports everything the GPU path imports (benchmarks/gpu_preflight.py) and collects tests/gpu.
#
# Exit status: 0 when every GPU test passed and every measurement ran (the targets are reported,
# MET or MISSED, in OUT_DIR/<device>.md); 1 when a test or a measurement failed; 2 when there is
# no CUDA device (after the environment checks passed: nothing was run on a device, nothing was
# written); 3 when the environment is incomplete (a wheel or an import missing, tests/gpu not
# collected).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${1:-gpu_results}"
WHEELS="${GPU_WHEELS:-gpu_wheels}"
SITE="${GPU_SITE:-$ROOT/build/gpu_site}"
LOG="$ROOT/build/gpu_check_environment.txt"
mkdir -p "$ROOT/build"
: > "$LOG"
# Note: every step runs under `timeout` (its process group, killed 5 s after the signal), each
# capped by what is left of the kit's 450 s, so the whole kit ends within 8 minutes whatever
# hangs (a remote run then has room for a rerun).
DEADLINE=$((SECONDS + ${GPU_KIT_BUDGET_S:-450}))
cap() {  # the smaller of $1 seconds and what is left before the deadline (at least 1)
    local left=$((DEADLINE - SECONDS))
    [ "$left" -lt 1 ] && left=1
    echo $(($1 < left ? $1 : left))
}

environment_incomplete() {
    echo "gpu_check: the environment is incomplete ($1); nothing was run on a device. See docs/gpu.md." >&2
    exit 3
}

echo "== 0/4 environment: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])') =="
if [ -d "$WHEELS" ]; then
    timeout -k 5 "$(cap 30)" "$PY" -m benchmarks.gpu_wheels install --wheels "$WHEELS" --target "$SITE" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || environment_incomplete "the wheels in $WHEELS/ did not install"
    export PYTHONPATH="$SITE:$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_check: no $WHEELS/ here: using the packages $PY has" | tee -a "$LOG"
    export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
timeout -k 5 "$(cap 60)" "$PY" -m benchmarks.gpu_preflight --site "$SITE" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || environment_incomplete "an import of the GPU path failed"
timeout -k 5 "$(cap 60)" "$PY" -m pytest --collect-only -q -p no:cacheprovider tests/gpu 2>&1 | tail -n 1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || environment_incomplete "tests/gpu was not collected"
echo "gpu_check: environment ready (the GPU path imports, tests/gpu collected)" | tee -a "$LOG"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device: torch.cuda.is_available() is False on $(hostname) (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null))." >&2
    echo "gpu_check: nothing was run. Run this on a machine with an NVIDIA GPU and a CUDA build of torch (docs/gpu.md)." >&2
    exit 2
fi

DEVICE="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
NAME="$(printf '%s' "$DEVICE" | tr -cs 'A-Za-z0-9' '-' | sed 's/^-*//; s/-*$//')"
mkdir -p "$OUT/logs"
cp "$LOG" "$OUT/logs/environment.txt"
echo "gpu_check: $DEVICE; writing $OUT/$NAME.*"
status=0

echo "== 1/4 CUDA tests at W=1 with NCCL (tests/gpu) =="
timeout -k 5 "$(cap 150)" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu --junitxml "$OUT/$NAME.tests.xml" 2>&1 | tee "$OUT/logs/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2/4 ~1.1B Llama-shaped decoder, bf16: shardline FULL_SHARD (eager, compiled) vs torch FSDP2 vs the plain model =="
timeout -k 5 "$(cap 170)" "$PY" -m benchmarks.gpu_bench --out "$OUT/$NAME.bench.json" 2>&1 | tee "$OUT/logs/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 3/4 CPU offload: device memory saved and step-time cost (~0.5B, 8 layers, W=1) =="
timeout -k 5 "$(cap 60)" "$PY" -m benchmarks.gpu_offload --out "$OUT/$NAME.offload.json" 2>&1 | tee "$OUT/logs/offload.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 4/4 its checkpoints: async save's blocking time and verified load's time vs plain DCP =="
limit="$(cap 140)"  # no further save round starts within 40 s of its end
timeout -k 5 "$limit" "$PY" -m benchmarks.gpu_checkpoint --out "$OUT/$NAME.checkpoint.json" --budget-s $((limit > 60 ? limit - 40 : 20)) 2>&1 | tee "$OUT/logs/checkpoint.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

{
    echo "# shardline GPU check: $DEVICE"
    echo
    echo "- device: $DEVICE"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # a copied tree may have no .git: then the commit gpu_wheels/ was prepared at (benchmarks/gpu_prepare.sh)
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || cat "$WHEELS/PREPARED.txt" 2>/dev/null || echo unknown)"
    echo "- torch: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
    echo "- kit: $SECONDS s in all (cap ${GPU_KIT_BUDGET_S:-450} s); exit $status"
    echo
    echo "## Environment"
    echo
    echo '```'
    cat "$LOG"
    echo '```'
    echo
    echo "## CUDA tests (tests/gpu, W=1, NCCL)"
    echo
    echo '```'
    tail -n 15 "$OUT/logs/tests.txt"
    echo '```'
    echo
    echo "## Benchmark: step time, tokens/s, MFU, peak memory"
    echo
    # the final report: from the last "device:" line on (each row was also printed as it was measured)
    awk '/^device: /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$OUT/logs/bench.txt" | grep -v '^\[rank'
    grep -h '^gpu_bench: .* failed' "$OUT/logs/bench.txt"
    echo
    echo "## CPU offload (benchmarks/gpu_offload.py)"
    echo
    grep -h '^| \|^- \|^gpu_offload: ' "$OUT/logs/offload.txt"
    echo
    echo "## Checkpoints of the same model"
    echo
    echo '```'
    grep -h '^device: \|^  round \|^gpu_checkpoint: ' "$OUT/logs/checkpoint.txt"
    echo '```'
    echo
    awk '/^\| async save/{on=1} on' "$OUT/logs/checkpoint.txt" | grep -v '^\[rank'
} > "$OUT/$NAME.md"
echo "gpu_check: results in $OUT/$NAME.md (exit $status)"
exit "$status"
