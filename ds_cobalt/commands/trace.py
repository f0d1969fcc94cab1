"""`ds-cobalt trace`: routing trace tools (`synth`, `info`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

HELP = "routing trace tools: synth (synthetic trace), info (summary)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_verb", required=True, metavar="ACTION")
    synth = sub.add_parser("synth", help="write a synthetic trace with controllable skew and clustering")
    synth.add_argument("--num-experts", type=int, required=True)
    synth.add_argument("--top-k", type=int, required=True)
    synth.add_argument("--tokens", type=int, required=True)
    synth.add_argument("--layers", type=int, default=1)
    synth.add_argument("--gini", type=float, default=0.3, help="load skew, Gini of expert popularity [0, 1)")
    synth.add_argument("--clustering", type=float, default=0.6,
                       help="share of a token's choices inside its co-activation cluster [0, 1)")
    synth.add_argument("--clusters", type=int, default=None)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--out", required=True)
    info = sub.add_parser("info", help="print shapes and statistics of a trace")
    info.add_argument("trace")


def run(args: argparse.Namespace) -> int:
    from ..planner.files import check_output_file
    from ..planner.trace import load_trace, save_trace
    from ..sim.synth import gini, synth_trace

    if args.trace_verb == "synth":
        check_output_file(args.out, "--out")
        trace = synth_trace(num_experts=args.num_experts, top_k=args.top_k, num_tokens=args.tokens,
                            num_layers=args.layers, gini=args.gini, clustering=args.clustering,
                            num_clusters=args.clusters, seed=args.seed)
        save_trace(trace, args.out)
        print(f"wrote {args.out}: L={trace.num_layers} T={trace.num_tokens} K={trace.top_k} E={trace.num_experts}")
        return 0
    trace = load_trace(args.trace)
    print(f"layers={trace.num_layers} tokens={trace.num_tokens} top_k={trace.top_k} "
          f"num_experts={trace.num_experts} source_rank={'yes' if trace.source_rank_T is not None else 'no'} "
          f"weights={'yes' if trace.weights_LTK is not None else 'no'}")
    for layer in range(trace.num_layers):
        used, load = used_expert_loads(trace.experts_LTK[layer])
        print(f"layer {layer}: load gini {gini(load, size=trace.num_experts):.3f}, unused experts "
              f"{trace.num_experts - used.size}, dropped ids {int((trace.experts_LTK[layer] < 0).sum())}")
    return 0


def used_expert_loads(topk_ids_TK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(experts, tokens)`: the experts that tokens chose and how many tokens chose each (a token listing an expert
    twice counts once), without an `[E]` or `[E, E]` array (E may be far larger than the experts used)."""
    import numpy as np

    ids = np.sort(np.asarray(topk_ids_TK), axis=1)
    repeat = np.zeros(ids.shape, dtype=bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return np.unique(ids[(ids >= 0) & ~repeat], return_counts=True)
