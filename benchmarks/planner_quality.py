"""Planner quality: cross-node tokens/token and GPU balance per trace and policy (plan on one half of the
tokens, score on the other half), against a simulated-annealing stage 1 reference.

    python benchmarks/planner_quality.py [--sa-seconds 60] [--traces a.npz b.npz ...]

Prints a markdown table (ratios measured in this one run; nothing is asserted).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ds_cobalt.planner.layout import Layout
from ds_cobalt.planner.objective import PartitionState
from ds_cobalt.planner.policies import plan_layout
from ds_cobalt.planner.stage2 import plan_gpus
from ds_cobalt.planner.stats import RoutingStats
from ds_cobalt.planner.trace import Trace, load_trace
from ds_cobalt.sim.metrics import simulate
from ds_cobalt.sim.synth import synth_trace

SYNTH = [  # name, E, K, nodes, gpus/node, tokens, gini, clustering
    ("synth-E64-k6-4x4", 64, 6, 4, 4, 40000, 0.4, 0.6),
    ("synth-E128-k8-4x8", 128, 8, 4, 8, 40000, 0.3, 0.5),
    ("synth-E256-k8-8x8", 256, 8, 8, 8, 40000, 0.5, 0.7),
]


def anneal(stats: RoutingStats, nodes: int, seconds: float, seed: int = 0, tolerance: float = 0.05) -> np.ndarray:
    """Simulated annealing on exact connectivity (random swaps, node load within the same bound)."""
    from ds_cobalt.planner.stage1 import plan_nodes

    rng = np.random.default_rng(seed)
    load_E = stats.load_E.astype(np.float64)
    start = plan_nodes(load_E, stats.coact_EE, stats.sets_MK, stats.count_M, nodes, load_tolerance=tolerance)
    st = PartitionState(stats.sets_MK, stats.count_M, start, nodes)
    bound = max((1 + tolerance) * load_E.sum() / nodes, np.bincount(start, load_E, nodes).max())
    load_N = np.bincount(start, load_E, nodes)
    cur = best_val = st.value()
    best = st.node_of_E.copy()
    t0 = time.perf_counter()
    temp0 = 0.002 * stats.count_M.sum() / max(nodes, 1)
    E = load_E.size
    while (elapsed := time.perf_counter() - t0) < seconds:
        temp = temp0 * (1 - elapsed / seconds) + 1e-9
        for _ in range(200):
            a, b = rng.integers(0, E, 2)
            A, B = st.node_of_E[a], st.node_of_E[b]
            if A == B:
                continue
            d = load_E[b] - load_E[a]
            if max(load_N[A] + d, load_N[B] - d) > bound:
                continue
            gain = st.swap_delta(int(a), int(b))
            if gain >= 0 or rng.random() < np.exp(gain / temp):
                st.apply_swap(int(a), int(b))
                load_N[A] += d
                load_N[B] -= d
                cur -= gain
                if cur < best_val - 1e-9:
                    best_val, best = cur, st.node_of_E.copy()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sa-seconds", type=float, default=60.0)
    ap.add_argument("--traces", nargs="*", default=[], help="extra .npz traces as PATH:NODES:GPUS")
    ap.add_argument("--redundant-slots", type=int, default=1)
    args = ap.parse_args()
    cases: list[tuple[str, Trace, int, int]] = []
    for name, E, K, N, G, T, g, c in SYNTH:
        cases.append((name, synth_trace(num_experts=E, top_k=K, num_tokens=T, gini=g, clustering=c, seed=7), N, G))
    for spec in args.traces:
        path, n, gpn = spec.split(":")
        cases.append((path, load_trace(path), int(n), int(gpn)))
    R = args.redundant_slots
    print("| trace | policy | R | cross-node tok/tok | vs DeepSpeed pairs | vs SA ref (R=0) | GPU max/mean | node max/mean | plan s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, trace, N, G in cases:
        rng = np.random.default_rng(0)
        perm = rng.permutation(trace.num_tokens)
        half = trace.num_tokens // 2
        plan_tr, test_tr = trace.select_tokens(np.sort(perm[:half])), trace.select_tokens(np.sort(perm[half:]))
        # Reference: annealed stage 1 (no spare slots), GPUs packed by stage 2, scored on the other half.
        ref_slots = []
        for layer in range(trace.num_layers):
            st = RoutingStats.from_topk(plan_tr.experts_LTK[layer], trace.num_experts)
            node_of_E = anneal(st, N, args.sa_seconds / trace.num_layers)
            load_NE = np.zeros((N, trace.num_experts))
            load_NE[node_of_E, np.arange(trace.num_experts)] = st.load_E
            ref_slots.append(plan_gpus(node_of_E, np.zeros((N, trace.num_experts), bool), load_NE, G, 0))
        ref = simulate(test_tr, Layout(trace.num_experts, N, G, np.stack(ref_slots)))["mean"]
        ref_x = ref["cross_node_tokens_per_token"]
        print(f"| {name} | SA-reference ({args.sa_seconds:.0f}s) | 0 | {ref_x:.3f} | "
              f"{ref_x / ref['deepspeed_cross_node_pairs_per_token']:.3f} | 1.000 | "
              f"{ref['gpu_load_max_over_mean']:.3f} | {ref['node_load_max_over_mean']:.3f} | {args.sa_seconds:.0f} |")
        for r in (0, R):
            for policy in ("deepspeed", "load", "eplb", "pairwise", "cobalt"):
                t0 = time.perf_counter()
                layout = plan_layout(plan_tr, N, G, r, policy)
                dt = time.perf_counter() - t0
                m = simulate(test_tr, layout)["mean"]
                x = m["cross_node_tokens_per_token"]
                print(f"| {name} | {policy} | {r} | {x:.3f} | {x / m['deepspeed_cross_node_pairs_per_token']:.3f} | "
                      f"{x / ref_x:.3f} | {m['gpu_load_max_over_mean']:.3f} | {m['node_load_max_over_mean']:.3f} | "
                      f"{dt:.2f} |", flush=True)


if __name__ == "__main__":
    main()
