#!/usr/bin/env bash
# Install ds_cobalt and everything it needs into the current Python, then prebuild DeepSpeed's CPU
# shared-memory comm op so the first launch does not pay for it. Idempotent: repeats take seconds.
#   bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# The shm op and DeepSpeed's JIT builds need a C++ compiler.
if ! command -v g++ >/dev/null && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi

# Open MPI for mpirun launches (`deepspeed --launcher openmpi`, mpi4py discovery); Debian packages, root only.
if ! command -v mpirun >/dev/null && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

# torch first and pinned: an unpinned torch (as pulled in by deepspeed) is the multi-GB CUDA build.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test,hf]"  # hf: transformers/accelerate/mpi4py, pinned
command -v pyenv >/dev/null && pyenv rehash || true  # make the new `deepspeed` / `ds-cobalt` shims visible

# Prebuild DeepSpeed's shm comm op (CPU accelerator only; cached under ~/.cache/torch_extensions).
"$PY" - <<'PY'
import time
from deepspeed.accelerator import get_accelerator

builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and get_accelerator().device_name() == "cpu":
    t0 = time.perf_counter()
    builder.load(verbose=False)
    print(f"[setup] DeepSpeed shm comm op ready ({time.perf_counter() - t0:.1f} s)")
PY
# Compile the planner's numba kernels once (cached beside their sources), so the first re-plan does not pay it.
"$PY" -m ds_cobalt.planner.worker --warm-up
echo "[setup] done"
