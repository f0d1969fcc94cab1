"""`ds-cobalt report RUN_DIR`: PNG figures and a small HTML page from the metrics a run directory holds."""

from __future__ import annotations

import argparse

HELP = "render PNGs and index.html from run metrics, traces, layouts and layout_changes.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="folder with train_moe.py --metrics-out JSON files (and sub-folders)")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    parser.add_argument("--layer", type=int, default=0, help="MoE layer of the trace to plot")


def run(args: argparse.Namespace) -> int:
    from ..sim.report import render_report

    page = render_report(args.run_dir, args.out, layer=args.layer)
    print(f"wrote {page}")
    return 0
