"""`benchmarks/layout_drift.py`: each recorded layout priced on each stretch of the recorded routing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def test_layout_drift_prices_every_layout_on_every_window(tmp_path: Path) -> None:
    # 2 nodes x 2 ranks, 4 experts, top-1, 2 steps of 2 tokens per rank (rows step-major here: the script splits each
    # rank's rows by step). Step 0 routes every token to its own rank's expert 0-3 under the contiguous layout,
    # step 1 to the expert two ranks away (the other node); the layout from step 1 swaps the nodes' experts.
    own = np.arange(4)
    experts = np.concatenate([np.repeat(own, 2), np.repeat((own + 2) % 4, 2)])[None, :, None]
    source = np.tile(np.repeat(own, 2), 2)
    np.savez(tmp_path / "trace.npz", experts=experts, num_experts=4, source_rank=source)
    layout = {"format": "ds-cobalt/layout-v1", "num_experts": 4, "nodes": 2, "gpus_per_node": 2, "slots_per_gpu": 1}
    layouts = [{"from_step": 0, "layout": {**layout, "layers": [{"slots": [[0], [1], [2], [3]]}]}},
               {"from_step": 1, "layout": {**layout, "layers": [{"slots": [[2], [3], [0], [1]]}]}}]
    (tmp_path / "metrics.json").write_text(json.dumps({"step_times_s": [0.1, 0.1], "layouts": layouts}))
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/layout_drift.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "| 0-0 | 0.000* | 1.000 |" in out, out
    assert "| 1-1 | 1.000 | 0.000* |" in out, out
