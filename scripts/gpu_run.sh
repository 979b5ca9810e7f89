#!/usr/bin/env bash
# On a GPU machine, from a checkout set up by scripts/setup_env.sh:
#
#   bash scripts/gpu_run.sh [--no-bench] [PYTEST ARGS...]
#
# prints the GPU, runs pytest on PYTEST ARGS (default: tests), then the main job's default run
# (benchmarks/moe_step.py: about 2 minutes on one H100; MOE_STEP_ARGS adds options to it) unless
# --no-bench is given. Logs and results go under ${OUT:-gpu-out}: gpu.txt, pytest.log,
# moe_step.log and results/ (moe_step_<GPU>_base.{json,md,png}). Python: $PYTHON, else .venv's,
# else python3. Exit status: pytest's if it failed, else the benchmark's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/results"
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
bench=1
if [ "${1:-}" = "--no-bench" ]; then
    bench=0
    shift
fi
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests)
export PYTHONUNBUFFERED=1

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi failed"; } 2>&1 |
    tee "$OUT/gpu.txt"
echo "+ $PY -m pytest -ra -p no:cacheprovider ${tests[*]}" | tee "$OUT/pytest.log"
"$PY" -m pytest -ra -p no:cacheprovider "${tests[@]}" 2>&1 | tee -a "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$bench" = 1 ]; then
    echo "+ $PY benchmarks/moe_step.py --out $OUT/results ${MOE_STEP_ARGS:-}" | tee "$OUT/moe_step.log"
    # shellcheck disable=SC2086  # MOE_STEP_ARGS: options, split on blanks
    "$PY" benchmarks/moe_step.py --out "$OUT/results" ${MOE_STEP_ARGS:-} 2>&1 | tee -a "$OUT/moe_step.log"
    brc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && rc=$brc
fi
exit "$rc"
