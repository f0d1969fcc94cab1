"""`ds-cobalt simulate`: score a layout on a routing trace (or replay it with the two-timescale policy)."""

from __future__ import annotations

import argparse
import json

HELP = "simulate cross-node traffic and load balance of a layout on a trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="routing trace .npz")
    parser.add_argument("--layout", required=True, help="layout .json")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--replay", action="store_true",
                        help="replay the trace step by step: stage 1 every --replan-interval steps, stage 2 every step")
    parser.add_argument("--replan-interval", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16, help="steps the trace is cut into for --replay")
    parser.add_argument("--decay", type=float, default=0.7, help="EMA decay of the statistics for --replay")


def run(args: argparse.Namespace) -> int:
    from ..planner.layout import load_layout
    from ..planner.trace import load_trace
    from ..sim.metrics import METRICS, simulate

    trace = load_trace(args.trace)
    layout = load_layout(args.layout)
    if args.replay:
        from tqdm import tqdm

        from ..sim.replay import replay

        with tqdm(total=trace.num_layers, desc="replay", unit="layer", disable=args.json) as bar:
            report = replay(trace, layout, steps=args.steps, replan_interval=args.replan_interval,
                            decay=args.decay, progress=lambda _: bar.update(1))
    else:
        report = simulate(trace, layout)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    width = max(len(m) for m in METRICS)
    header = "layer".ljust(7) + "".join(m.rjust(width + 2) for m in METRICS)
    print(header)
    for i, row in enumerate(report["layers"]):
        print(str(i).ljust(7) + "".join(f"{row[m]:.4f}".rjust(width + 2) for m in METRICS))
    print("mean".ljust(7) + "".join(f"{report['mean'][m]:.4f}".rjust(width + 2) for m in METRICS))
    if args.replay:
        print(f"replans: {report['replans']}, migrations: {report['migrations']}")
    return 0
