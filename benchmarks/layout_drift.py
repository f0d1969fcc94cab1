"""How well each layout a run used serves the routing of other stretches of the same run.

    python benchmarks/layout_drift.py RUN_DIR [--windows 0:1 2:12 13:25 30:55]

`RUN_DIR` is one job of `benchmarks/e2e_cluster.py` (or `examples/train_moe.py --metrics-out RUN_DIR/metrics.json
--trace-out RUN_DIR/trace.npz`): `metrics.json` lists every layout the layers used with the step it served from
(`layouts`), `trace.npz` the routing of every step (DESIGN.md trace format; each rank's rows in step order). For
each layer and window of steps [a, b) it prints the mean number of remote nodes per token (the runtime's task
assignment, `cross_node_per_token`) under every recorded layout, the layout in use marked with `*`. A re-plan
whose layout is better on its own planning step but worse on the steps after it than the one it replaced
chases routing that has already moved on. Default windows: the stretches between the layout changes. Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ds_cobalt.planner.decisions import cross_node_per_token
from ds_cobalt.planner.layout import layout_from_dict
from ds_cobalt.planner.trace import load_trace


def step_rows(source_rank_T: np.ndarray, steps: int) -> list[np.ndarray]:
    """Row indices of each step (all ranks): each rank's rows, in order, split into `steps` equal parts."""
    per_rank = [np.flatnonzero(source_rank_T == r) for r in np.unique(source_rank_T)]
    if any(len(rows) % steps for rows in per_rank):
        raise ValueError(f"the trace's rows per rank ({[len(r) for r in per_rank]}) do not split into {steps} steps")
    return [np.concatenate([rows.reshape(steps, -1)[s] for rows in per_rank]) for s in range(steps)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--windows", nargs="*", default=None, help="a:b step windows (0-based, b excluded)")
    args = p.parse_args(argv)
    metrics = json.loads((args.run_dir / "metrics.json").read_text())
    trace = load_trace(args.run_dir / "trace.npz")
    steps = len(metrics["step_times_s"])
    recorded = metrics.get("layouts")
    if not recorded:
        raise SystemExit(f"{args.run_dir / 'metrics.json'}: no `layouts` (a ds_cobalt run of examples/train_moe.py)")
    starts = [int(entry["from_step"]) for entry in recorded]
    layouts = [layout_from_dict(entry["layout"], source="metrics layouts") for entry in recorded]
    experts_LTK, source_T = trace.experts_LTK, trace.source_ranks(layouts[0].world_size)
    if args.windows:
        windows = [tuple(int(v) for v in w.split(":")) for w in args.windows]
    else:
        bounds = sorted(set(starts + [steps]))
        windows = list(zip(bounds[:-1], bounds[1:]))
    by_step = step_rows(source_T, steps)
    print(f"{args.run_dir}: remote nodes per token under each layout (columns: the layouts from steps "
          f"{', '.join(map(str, starts))}; * = in use at the window's start)")
    for layer in range(experts_LTK.shape[0]):
        print(f"| layer {layer} steps | " + " | ".join(f"from {s}" for s in starts) + " |")
        print("|---|" + "---|" * len(starts))
        for a, b in windows:
            rows = np.concatenate(by_step[a:b])
            in_use = max(i for i, s in enumerate(starts) if s <= a)
            cells = []
            for i, layout in enumerate(layouts):
                value = cross_node_per_token(experts_LTK[layer, rows], source_T[rows], layout.layer(layer),
                                             layout.gpus_per_node)
                cells.append(f"{value:.3f}" + ("*" if i == in_use else ""))
            print(f"| {a}-{b - 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
