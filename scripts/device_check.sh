#!/usr/bin/env bash
# On the GPU machine (see README "GPU tests"): run the test suite, then the offload benchmark.
# Logs and results go under $OUT (the device tool's output folder) or ./device-out.
set -uo pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -ra -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
[ -n "${TEO_SKIP_BENCH:-}" ] || python3 benchmarks/offload_policies.py --out "$OUT/results" 2>&1 | tee "$OUT/bench.log"
exit "$rc"
