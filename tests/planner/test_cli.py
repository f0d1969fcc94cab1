"""`ds-cobalt` CLI through subprocesses (the torch-free import of the planner: tests/test_architecture.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ds_cobalt.planner.layout import load_layout

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_cobalt.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_cli_synth_plan_simulate_replay(tmp_path):
    trace, layout, plot = tmp_path / "t.npz", tmp_path / "l.json", tmp_path / "l.png"
    res = _cli("trace", "synth", "--num-experts", "16", "--top-k", "2", "--tokens", "600", "--layers", "2",
               "--out", str(trace))
    assert res.returncode == 0, res.stderr
    res = _cli("plan", "--trace", str(trace), "--nodes", "2", "--gpus-per-node", "2", "--redundant-slots", "1",
               "--plot", str(plot), "--out", str(layout))
    assert res.returncode == 0, res.stderr
    assert load_layout(layout).slots_per_gpu == 5 and plot.stat().st_size > 0
    res = _cli("simulate", "--trace", str(trace), "--layout", str(layout), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert len(report["layers"]) == 2
    for key in ("cross_node_tokens_per_token", "deepspeed_cross_node_pairs_per_token",
                "gpu_load_max_over_mean", "node_load_max_over_mean"):
        assert key in report["mean"]
    res = _cli("simulate", "--trace", str(trace), "--layout", str(layout))
    assert res.returncode == 0 and "mean" in res.stdout
    res = _cli("simulate", "--trace", str(trace), "--layout", str(layout), "--replay", "--replan-interval", "2",
               "--steps", "4", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["replans"] == 2


def test_cli_errors_are_clean(tmp_path):
    trace = tmp_path / "t.npz"
    np.savez(trace, experts=np.full((1, 4, 2), 20), num_experts=np.asarray(16))
    res = _cli("plan", "--trace", str(trace), "--nodes", "2", "--gpus-per-node", "2", "--out", str(tmp_path / "l"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "'experts' holds id 20" in res.stderr
    np.savez(trace, experts=np.zeros((1, 4, 2), np.int64), num_experts=np.asarray(16))
    res = _cli("plan", "--trace", str(trace), "--nodes", "3", "--gpus-per-node", "2", "--out", str(tmp_path / "l"))
    assert res.returncode == 2 and "does not divide num_experts=16" in res.stderr
    bad_layout = tmp_path / "bad.json"
    bad_layout.write_text(json.dumps({"format": "ds-cobalt/layout-v1", "num_experts": 16, "nodes": 2,
                                      "gpus_per_node": 2, "slots_per_gpu": 4,
                                      "layers": [{"slots": [[0, 1, 2, 3]] * 4}]}))
    res = _cli("simulate", "--trace", str(trace), "--layout", str(bad_layout))
    assert res.returncode == 2 and "missing expert" in res.stderr and "Traceback" not in res.stderr
    res = _cli("simulate", "--trace", str(tmp_path / "nope.npz"), "--layout", str(bad_layout))
    assert res.returncode == 2 and "no such file" in res.stderr
