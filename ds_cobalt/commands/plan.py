"""`ds-cobalt plan`: compute a layout from a routing trace."""

from __future__ import annotations

import argparse

HELP = "plan an expert layout from a routing trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..planner.policies import POLICIES

    parser.add_argument("--trace", required=True, help="routing trace .npz")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--redundant-slots", type=int, default=0, help="spare slots per GPU (default 0)")
    parser.add_argument("--policy", default="cobalt", choices=sorted(POLICIES), help="default: cobalt")
    parser.add_argument("--current", help="layout in use: stage 1 keeps as many experts in place as it can")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="also write a plot of the layout (png)")
    parser.add_argument("--out", required=True, help="layout .json to write")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..planner.layout import load_layout, save_layout
    from ..planner.policies import plan_layout
    from ..planner.trace import load_trace
    from .paths import check_output_file

    check_output_file(args.out, "--out")
    if args.plot:
        check_output_file(args.plot, "--plot")
    trace = load_trace(args.trace)
    current = load_layout(args.current) if args.current else None
    with tqdm(total=trace.num_layers, desc=f"plan {args.policy}", unit="layer",
              disable=trace.num_layers < 4) as bar:
        layout = plan_layout(trace, args.nodes, args.gpus_per_node, args.redundant_slots, args.policy,
                             current=current, seed=args.seed, progress=lambda _: bar.update(1))
    save_layout(layout, args.out)
    print(f"wrote {args.out}: {layout.num_layers} layer(s), {layout.world_size} ranks x "
          f"{layout.slots_per_gpu} slots, policy {args.policy}")
    if args.plot:
        from ..sim.plot import plot_layout

        plot_layout(trace, layout, args.plot)
        print(f"wrote {args.plot}")
    return 0
