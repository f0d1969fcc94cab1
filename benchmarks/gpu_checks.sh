#!/usr/bin/env bash
# GPU session entry point: make sure CuPy (matching the driver's CUDA major version) and DeepSpeed are
# importable, then run benchmarks/gpu_checks.py (kernel tests + timings) and benchmarks/gpu_moe_check.py
# (ds_cobalt.MoE vs DeepSpeed's MoE on CUDA, every schedule, bf16); results under $OUT.
#   OUT=./gpu_results bash benchmarks/gpu_checks.sh [--skip-tests] [--iters N]
# GPU machines without network install from wheels in .whl/: fetch them first on a machine with network
# (Python 3.12, x86-64 wheels by default: PYVER=3.11 to change):
#   bash benchmarks/gpu_checks.sh --fetch-wheels
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OUT=${OUT:-./gpu_results}

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  "$PY" -m pip download -q --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    "pydantic>=2" hjson annotated-types typing-inspection
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
  ls -la .whl
  exit 0
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site-ds .whl/*.whl \
      && export PYTHONPATH="/tmp/site-ds:$PYTHONPATH"
  else
    "$PY" -m pip install -q deepspeed==0.19.8 || {
      echo "no DeepSpeed and no network: run 'bash benchmarks/gpu_checks.sh --fetch-wheels' where pip can download" >&2
      exit 2; }
  fi
fi

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
status=0
"$PY" benchmarks/gpu_checks.py "$@" || status=$?
"$PY" benchmarks/gpu_moe_check.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/gpu_moe_check.log" || status=$?
exit $status
