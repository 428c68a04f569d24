#!/usr/bin/env bash
# The GPU checks in one run (for a machine with an NVIDIA GPU, e.g. an H200): the Triton kernels are checked
# against their references on the device, then timed at LLaVA-1.5-7B shapes beside dense SDPA (achieved
# bandwidth on the bytes each reads), then the scoring overheads at LLaVA-1.5-7B's layer shape in bf16.
#
#   scripts/device_check.sh OUT_DIR        # writes OUT_DIR/kernels.json, OUT_DIR/overhead.json and the logs
set -euo pipefail
OUT=${1:?usage: scripts/device_check.sh OUT_DIR}
PY=${PY:-python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
"$PY" -m mm_oval.kernels.bench --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"
"$PY" benchmarks/bench_overhead.py --device cuda --dtype bfloat16 --repeats 20 --out "$OUT/overhead.json" 2>&1 \
    | tee "$OUT/overhead.txt"
# the page scoring on 4x4 tiles (16-token pages), the layout that fits a 25% bytes budget
"$PY" benchmarks/bench_overhead.py --device cuda --dtype bfloat16 --repeats 20 --image-tile 4 \
    --out "$OUT/overhead_tile4.json" 2>&1 | tee "$OUT/overhead_tile4.txt"
