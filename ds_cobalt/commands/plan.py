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
    price = parser.add_argument_group(
        "traffic copies' price (all three, or none: copies free), as the runtime's re-plans price them: counted as "
        "the busiest inter-node link carries them, with a NIC per GPU")
    price.add_argument("--expert-params", type=int, default=None, help="parameters per expert (bf16 weights)")
    price.add_argument("--hidden-bytes", type=int, default=None,
                       help="bytes of one token's hidden state on the wire (e.g. 8192: 4096 x bf16)")
    price.add_argument("--tokens-per-step", type=int, default=None,
                       help="tokens of one training step over the expert-parallel group")
    parser.add_argument("--out", required=True, help="layout .json to write")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..planner.files import check_output_file
    from ..planner.layout import load_layout, save_layout
    from ..planner.policies import plan_layout
    from ..planner.trace import load_trace

    check_output_file(args.out, "--out")
    if args.plot:
        check_output_file(args.plot, "--plot")
    copy_cost = _copy_cost(args)
    trace = load_trace(args.trace)
    current = load_layout(args.current) if args.current else None
    with tqdm(total=trace.num_layers, desc=f"plan {args.policy}", unit="layer",
              disable=trace.num_layers < 4) as bar:
        layout = plan_layout(trace, args.nodes, args.gpus_per_node, args.redundant_slots, args.policy,
                             current=current, seed=args.seed, copy_cost=copy_cost,
                             progress=lambda _: bar.update(1))
    save_layout(layout, args.out)
    print(f"wrote {args.out}: {layout.num_layers} layer(s), {layout.world_size} ranks x "
          f"{layout.slots_per_gpu} slots, policy {args.policy}")
    if args.plot:
        from ..sim.plot import plot_layout

        plot_layout(trace, layout, args.plot)
        print(f"wrote {args.plot}")
    return 0


_PRICE_FLAGS = ("expert_params", "hidden_bytes", "tokens_per_step")


def _copy_cost(args: argparse.Namespace) -> float:
    """What one cross-node traffic copy costs per step in cross-node tokens per token (0 without the price flags);
    ValueError naming a missing or bad flag."""
    from ..planner.migration import LinkModel, copy_cost_per_token

    given = {name: getattr(args, name) for name in _PRICE_FLAGS if getattr(args, name) is not None}
    if not given:
        return 0.0
    missing = [f"--{name.replace('_', '-')}" for name in _PRICE_FLAGS if name not in given]
    if missing:
        raise ValueError(f"pricing traffic copies needs {', '.join(missing)} too")
    for name, value in given.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    link = LinkModel(expert_params=args.expert_params, token_bytes=args.hidden_bytes)
    return copy_cost_per_token(link, args.tokens_per_step)
