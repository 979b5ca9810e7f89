#!/usr/bin/env bash
# Create .venv with torch, Transformer Engine 2.20.x (core matched to torch's CUDA major, torch
# extension built from source), the CuTe DSL and the test tools, then install this package.
# Safe to re-run: finished steps are skipped. Needs a CUDA toolkit (nvcc); no GPU needed.
# Env: TEO_VENV (default .venv), TEO_TORCH_SPEC (default "torch"), CUDA_HOME, MAX_JOBS.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TEO_VENV:-$ROOT/.venv}
TE_VERSION=2.20.2
CUTE_VERSION=4.8.1
say() { printf '[setup] %s\n' "$*"; }

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if ! "$PY" -c "import torch" 2>/dev/null; then
    say "installing ${TEO_TORCH_SPEC:-torch}"
    "${PIP[@]}" "${TEO_TORCH_SPEC:-torch}"
fi
CUDA_MAJOR=$("$PY" -c "import torch; v = torch.version.cuda; print(v.split('.')[0] if v else '')")
case "$CUDA_MAJOR" in
    12|13) ;;
    *) say "torch has no CUDA 12/13 build (torch.version.cuda=${CUDA_MAJOR:-None}); install a CUDA build of torch"; exit 1 ;;
esac
say "torch $("$PY" -c 'import torch; print(torch.__version__)') with CUDA $CUDA_MAJOR"

"${PIP[@]}" "transformer-engine[core_cu$CUDA_MAJOR]==$TE_VERSION" "nvidia-cutlass-dsl[cu$CUDA_MAJOR]==$CUTE_VERSION" \
    nvidia-cudnn-frontend ninja numpy pytest matplotlib

if ! "$PY" -c "import torch, transformer_engine_torch" 2>/dev/null; then
    # nvcc on PATH may be a wrapper script, so look for the toolkit directory itself.
    if [ -z "${CUDA_HOME:-}" ]; then
        CUDA_HOME=/usr/local/cuda
        [ -x "$CUDA_HOME/bin/nvcc" ] || CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /x/x/nvcc)")")")
    fi
    [ -x "$CUDA_HOME/bin/nvcc" ] || { say "no nvcc under CUDA_HOME=$CUDA_HOME: a CUDA toolkit is needed to build TE's torch extension"; exit 1; }
    NV=$("$PY" -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0] + '/x'))")
    # The toolkit may lack cusparse.h/nccl.h/cudnn.h; the pip NVIDIA packages carry them.
    shopt -s nullglob; incs=("$NV"/*/include); shopt -u nullglob
    INC=$(IFS=:; echo "${incs[*]}")
    say "building transformer-engine-torch $TE_VERSION from source (about 17 min on 2 cores the first time; pip caches the wheel)"
    CUDA_HOME="$CUDA_HOME" CPLUS_INCLUDE_PATH="$INC${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    NVTE_WITH_NCCL_EP=0 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        "${PIP[@]}" --no-build-isolation "transformer-engine-torch==$TE_VERSION"
fi
"${PIP[@]}" --no-deps -e "$ROOT"
"$PY" -c "import te_offload_ops, transformer_engine.pytorch as te; print('[setup] ready: te_offload_ops on TE', te.__version__ if hasattr(te, '__version__') else '')"
