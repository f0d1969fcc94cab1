"""`benchmarks/e2e_cluster.py`'s summary: ratios to DeepSpeed's job of the same repeat and rank 0's CPU per step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e_cluster", REPO / "benchmarks" / "e2e_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, step_s: float, cpu_s: list[float] | None) -> None:
    folder.mkdir(parents=True)
    metrics = {"steps": 4, "tokens_per_s": 4096 / step_s, "step_times_s": [0.5, step_s, step_s, step_s],
               "losses": [3.0, 2.0, 1.5, 1.0], "traffic": {"inter_node_bytes": 4e6}}
    if cpu_s is not None:
        metrics["cpu_times_s"] = cpu_s
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_summary_reports_cpu_per_step_next_to_the_ratio(tmp_path):
    e2e = _e2e()
    _write(tmp_path / "1gbit-deepspeed", 0.2, [0.3, 0.08, 0.09, 0.07])
    _write(tmp_path / "1gbit-cobalt", 0.25, [0.3, 0.1, 0.12, 0.11])
    _write(tmp_path / "1gbit-cobalt-no-spare", 0.2, None)  # metrics written before the CPU times: no value
    summary = e2e.summarize(tmp_path, ["1gbit"], ["deepspeed", "cobalt", "cobalt-no-spare"])
    rows = {r["variant"]: r for r in summary["rows"]}
    assert abs(rows["cobalt"]["speedup_vs_deepspeed"] - 0.8) < 1e-9
    assert abs(rows["cobalt"]["cpu_ms_per_step"] - 110.0) < 1e-9  # the median after the first step
    assert abs(rows["deepspeed"]["cpu_ms_per_step"] - 80.0) < 1e-9
    assert rows["cobalt-no-spare"]["cpu_ms_per_step"] is None
    table = e2e.markdown({"rows": list(rows.values())}).splitlines()
    assert "CPU ms/step (rank 0)" in table[0]
    assert table[0].count("|") == table[1].count("|") == table[3].count("|") == table[4].count("|")
    assert "| 110.0 |" in table[3] and "| 80.0 |" in table[2]
    assert e2e.VARIANTS["cobalt-no-spare"]["cobalt"] == {"planner": {"redundant_slots": 0}}
