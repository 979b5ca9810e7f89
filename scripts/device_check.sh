#!/usr/bin/env bash
# On the GPU machine (see README "GPU tests"): run the test suite, then the offload benchmark.
# Logs and results go under $OUT (the device tool's output folder) or ./device-out: pytest.log,
# bench.log and results/ (JSON, markdown, PNG per routing), 8 files in all.
set -uo pipefail
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/pytest.log"
python3 -m pytest -ra -p no:cacheprovider "${@:-tests}" 2>&1 | tee -a "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
if [ -z "${TEO_SKIP_BENCH:-}" ]; then
    for routing in uniform skewed; do
        python3 benchmarks/offload_policies.py --routing "$routing" --out "$OUT/results" 2>&1 | tee -a "$OUT/bench.log"
    done
fi
exit "$rc"
