"""The GPU session's layer check (`benchmarks/gpu_moe_check.py`, run by `benchmarks/gpu_checks.sh`) on CPU.

A GPU is lent only to some sessions, and then for minutes: the script must still run as it is after the runtime
changed. On CPU (gloo, torch kernels, fp32) every case must match DeepSpeed's layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_moe_check_runs_every_case_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "MASTER_PORT": "29563"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_moe_check.py"), "--device", "cpu",
                           "--dtype", "float32", "--tokens", "96", "--hidden", "32", "--ffn", "48", "--iters", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((tmp_path / "gpu_moe_check.json").read_text())
    cases = results["cases"]
    names = {case["case"] for case in cases}
    assert {"hierarchical", "hierarchical_overlap_replicas", "direct_replicas", "dense"} <= names
    assert all(case["ok"] for case in cases), [case["case"] for case in cases if not case["ok"]]
