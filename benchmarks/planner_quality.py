"""Planner quality: cross-node tokens/token and GPU balance per trace and policy (plan on one half of the
tokens, score on the other half), against a simulated-annealing stage 1 reference.

    python benchmarks/planner_quality.py [--sa-seconds 60] [--trace a.npz[:NODES:GPUS]] ... [--no-synth]

Prints a markdown table (ratios measured in this one run; nothing is asserted). Recorded traces (DESIGN.md
`.npz`) are added with `--trace` (repeatable; topology from the suffix or `--nodes/--gpus-per-node`).
Cross-node copies (an expert held on a node other than its owner's) cost weight and gradient bytes every
step; the table prints them (bf16 weights fetched + bf16 gradients reduced, `LinkModel` sizes) next to the
token bytes they save against the R=0 row of the same policy (dispatch + combine, forward + backward) at
`--tokens-per-gpu` tokens per GPU per step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ds_cobalt.planner.layout import Layout
from ds_cobalt.planner.migration import LinkModel
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


def _cross_node_copies(layout: Layout) -> float:
    """Mean per layer of copies held on a node other than the expert's owner node."""
    E, G = layout.num_experts, layout.gpus_per_node
    out = []
    for layer in range(layout.num_layers):
        slots = layout.layer(layer)
        W = slots.shape[0]
        owner_node_E = np.empty(E, dtype=np.int64)
        owner_node_E[slots[:, : E // W].reshape(-1)] = np.repeat(np.arange(W) // G, E // W)
        node_WS = np.repeat((np.arange(W) // G)[:, None], slots.shape[1], axis=1)
        held = slots >= 0
        out.append(float((held & (owner_node_E[np.maximum(slots, 0)] != node_WS)).sum()))
    return float(np.mean(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sa-seconds", type=float, default=60.0, help="annealing reference time per trace")
    ap.add_argument("--trace", action="append", default=[], help="recorded .npz trace, PATH or PATH:NODES:GPUS")
    ap.add_argument("--traces", nargs="*", default=[], help="(old form) extra traces as PATH:NODES:GPUS")
    ap.add_argument("--nodes", type=int, default=4, help="topology for --trace without a suffix")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--no-synth", action="store_true", help="only the --trace traces")
    ap.add_argument("--redundant-slots", type=int, default=1)
    ap.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU per step (bytes columns)")
    ap.add_argument("--policies", default="deepspeed,load,eplb,pairwise,cobalt")
    args = ap.parse_args()
    link = LinkModel()
    cases: list[tuple[str, Trace, int, int]] = []
    if not args.no_synth:
        for name, E, K, N, G, T, g, c in SYNTH:
            cases.append((name, synth_trace(num_experts=E, top_k=K, num_tokens=T, gini=g, clustering=c, seed=7), N, G))
    for spec in args.trace + args.traces:
        path, *topo = spec.split(":")
        n, gpn = (int(topo[0]), int(topo[1])) if topo else (args.nodes, args.gpus_per_node)
        cases.append((path, load_trace(path), n, gpn))
    R = args.redundant_slots
    print("| trace | policy | R | cross-node tok/tok | vs DeepSpeed pairs | vs SA ref (R=0) | GPU max/mean | "
          "node max/mean | plan s | x-node copies/layer | copy MB/step | token MB saved/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
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
              f"{ref['gpu_load_max_over_mean']:.3f} | {ref['node_load_max_over_mean']:.3f} | {args.sa_seconds:.0f} "
              f"| 0 | 0 | 0 |")
        tokens_per_step = args.tokens_per_gpu * N * G
        for policy in args.policies.split(","):
            base_x = None
            for r in (0, R):
                t0 = time.perf_counter()
                layout = plan_layout(plan_tr, N, G, r, policy)
                dt = time.perf_counter() - t0
                m = simulate(test_tr, layout)["mean"]
                x = m["cross_node_tokens_per_token"]
                base_x = x if base_x is None else base_x
                copies = _cross_node_copies(layout)
                copy_mb = copies * link.expert_params * 2 * link.weight_bytes_per_param / 1e6
                saved_mb = (base_x - x) * tokens_per_step * link.token_bytes * 4 / 1e6
                print(f"| {name} | {policy} | {r} | {x:.3f} | {x / m['deepspeed_cross_node_pairs_per_token']:.3f} | "
                      f"{x / ref_x:.3f} | {m['gpu_load_max_over_mean']:.3f} | {m['node_load_max_over_mean']:.3f} | "
                      f"{dt:.2f} | {copies:.1f} | {copy_mb:.0f} | {saved_mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()
