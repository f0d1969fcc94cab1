#!/usr/bin/env bash
# GPU session entry point for the kernel checks: make sure a CuPy wheel matching the driver's CUDA major
# version is importable, then run benchmarks/gpu_checks.py (gpu tests + timings, results under $OUT).
#   OUT=./gpu_results bash benchmarks/gpu_checks.sh [--skip-tests] [--iters N]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OUT=${OUT:-./gpu_results}
mkdir -p "$OUT"

if ! "$PY" -c "import cupy" 2>/dev/null; then
  # "CUDA Version: 12.4" in nvidia-smi's header is the driver's CUDA; the wheel's major must not exceed it
  major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -1)
  case "$major" in
    12) wheel=cupy-cuda12x ;;
    13|14|15) wheel=cupy-cuda13x ;;
    *) echo "cannot tell the CUDA version from nvidia-smi (got '$major'); install cupy-cuda12x or cupy-cuda13x" >&2; exit 2 ;;
  esac
  if ls .whl/cupy_cuda*.whl >/dev/null 2>&1; then  # carried wheels (machines without network)
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  else
    "$PY" -m pip install -q "$wheel"
  fi
fi
"$PY" -c "import cupy, torch; print('cupy', cupy.__version__, '| torch', torch.__version__, 'CUDA', torch.version.cuda)"
exec "$PY" benchmarks/gpu_checks.py "$@"
