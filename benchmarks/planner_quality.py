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
FOUR_NODE = [  # 4-node topologies, top-2 and top-6 (`--cases four-node`)
    ("synth-E64-k2-4x2", 64, 2, 4, 2, 40000, 0.4, 0.6),
    ("synth-E64-k6-4x2", 64, 6, 4, 2, 40000, 0.4, 0.6),
    ("synth-E64-k2-4x4", 64, 2, 4, 4, 40000, 0.4, 0.6),
    ("synth-E64-k6-4x4", 64, 6, 4, 4, 40000, 0.4, 0.6),
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


def anneal_joint(stats: RoutingStats, topk_TK: np.ndarray, src_node_T: np.ndarray, nodes: int, spare: int,
                 seconds: float, seed: int = 0, tolerance: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Reference with `spare` copies per node: annealing over owner swaps and copy moves together on the exact
    replica-aware objective (`ReplicaPartitionState`), node load unbounded by default (GPU balance ignored).
    Starts from stage 1 + greedy traffic copies refined by `refine_joint`. Returns (owners, copies_NE)."""
    from ds_cobalt.planner.joint import node_load_model, refine_joint
    from ds_cobalt.planner.replicas import ReplicaPartitionState, traffic_replicas
    from ds_cobalt.planner.stage1 import plan_nodes

    rng = np.random.default_rng(seed)
    load_E = stats.load_E.astype(np.float64)
    E, N = load_E.size, nodes
    owners = plan_nodes(load_E, stats.coact_EE, stats.sets_MK, stats.count_M, N)
    holds = np.zeros((N, E), dtype=bool)
    holds[owners, np.arange(E)] = True
    copies = traffic_replicas(topk_TK, src_node_T, owners, holds, spare)
    loose = 10.0 if tolerance is None else tolerance
    owners, copies = refine_joint(stats.sets_MK, stats.count_M, load_E, owners, copies, spare, load_tolerance=loose)
    st = ReplicaPartitionState(stats.sets_MK, stats.count_M, owners, copies)
    held = [set(np.nonzero(copies[n])[0].tolist()) for n in range(N)]
    bound = np.inf if tolerance is None else max((1 + tolerance) * load_E.sum() / N,
                                                 node_load_model(load_E, owners, copies).max())
    cur = best_val = st.value()
    best = (st.node_of_E.copy(), st.copies_NE())
    temp0 = 0.002 * stats.count_M.sum() / N
    t0 = time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        temp = temp0 * (1 - elapsed / seconds) + 1e-9
        for _ in range(200):
            gain, commit = _owner_swap_move(st, rng, held) if rng.random() < 0.5 else _copy_move(st, rng, spare, held)
            if commit is not None and bound < np.inf and _over_bound(st, commit, load_E, bound):
                continue
            if commit is not None and (gain >= 0 or rng.random() < np.exp(gain / temp)):
                commit()
                cur -= gain
                if cur < best_val - 1e-9:
                    best_val, best = cur, (st.node_of_E.copy(), st.copies_NE())
    return best


def _over_bound(st, commit, load_E, bound) -> bool:  # noqa: ANN001
    """Whether the move `commit` would put a modelled node load over `bound` (the move is proposed: its
    swaps and toggles are the exact state changes, so this applies it to a copy of the owners and copies)."""
    from ds_cobalt.planner.joint import node_load_model

    owners, copies = commit.preview()
    return node_load_model(load_E, owners, copies).max() > bound + 1e-9


def _owner_swap_move(st, rng, held):  # noqa: ANN001, ANN202
    a, b = (int(v) for v in rng.integers(0, st.E, 2))
    A, B = int(st.node_of_E[a]), int(st.node_of_E[b])
    if A == B:
        return 0.0, None

    def commit() -> None:
        st.apply_swap(a, b)
        for n, e in ((B, a), (A, b)):  # a copy on the expert's new owner node is worth nothing: free its slot
            if e in held[n]:
                held[n].discard(e)
                st.toggle_copy(n, e)

    def preview() -> tuple[np.ndarray, np.ndarray]:
        owners, copies = st.node_of_E.copy(), st.copies_NE()
        owners[a], owners[b] = B, A
        return owners, copies & (owners[None, :] != np.arange(st.N)[:, None])

    commit.preview = preview
    return st.swap_delta(a, b), commit


def _copy_move(st, rng, spare, held):  # noqa: ANN001, ANN202
    N, E = st.N, st.E
    s, f = int(rng.integers(0, N)), int(rng.integers(0, E))
    if f in held[s] or st.node_of_E[f] == s:
        return 0.0, None
    if len(held[s]) < spare:
        def add() -> None:
            held[s].add(f)
            st.toggle_copy(s, f)

        add.preview = lambda: (st.node_of_E, _with(st.copies_NE(), s, f, True))
        return st.copy_gain(s, f), add
    e = list(held[s])[int(rng.integers(0, len(held[s])))]

    def move() -> None:
        held[s].discard(e)
        held[s].add(f)
        st.toggle_copy(s, e)
        st.toggle_copy(s, f)

    move.preview = lambda: (st.node_of_E, _with(_with(st.copies_NE(), s, e, False), s, f, True))
    return st.copy_move_delta(s, e, f), move


def _with(copies_NE: np.ndarray, s: int, e: int, value: bool) -> np.ndarray:
    copies_NE[s, e] = value
    return copies_NE


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
    ap.add_argument("--cases", choices=("default", "four-node", "all"), default="default", help="synthetic traces")
    ap.add_argument("--joint-seconds", type=float, default=0.0,
                    help="per trace: also anneal owners + R spare copies jointly (GPU balance ignored); 0 = off")
    ap.add_argument("--joint-tolerance", type=float, default=None,
                    help="also a joint reference with modelled node load within 1 + this of the mean")
    args = ap.parse_args()
    link = LinkModel()
    cases: list[tuple[str, Trace, int, int]] = []
    synth = {"default": SYNTH, "four-node": FOUR_NODE, "all": SYNTH + FOUR_NODE[:-1]}[args.cases]  # last in both
    if not args.no_synth:
        for name, E, K, N, G, T, g, c in synth:
            cases.append((name, synth_trace(num_experts=E, top_k=K, num_tokens=T, gini=g, clustering=c, seed=7), N, G))
    for spec in args.trace + args.traces:
        path, *topo = spec.split(":")
        n, gpn = (int(topo[0]), int(topo[1])) if topo else (args.nodes, args.gpus_per_node)
        cases.append((path, load_trace(path), n, gpn))
    R = args.redundant_slots
    print("| trace | policy | R | cross-node tok/tok | vs own R=0 | vs DeepSpeed pairs | vs SA ref (R=0) | "
          "GPU max/mean | node max/mean | plan s | x-node copies/layer | copy MB/step | token MB saved/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
        print(f"| {name} | SA-reference ({args.sa_seconds:.0f}s) | 0 | {ref_x:.3f} | 1.000 | "
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
                print(f"| {name} | {policy} | {r} | {x:.3f} | {x / base_x:.3f} | "
                      f"{x / m['deepspeed_cross_node_pairs_per_token']:.3f} | "
                      f"{x / ref_x:.3f} | {m['gpu_load_max_over_mean']:.3f} | {m['node_load_max_over_mean']:.3f} | "
                      f"{dt:.2f} | {copies:.1f} | {copy_mb:.0f} | {saved_mb:.0f} |", flush=True)
        if args.joint_seconds > 0 and R > 0:
            base = plan_layout(plan_tr, N, G, 0, "cobalt")
            for tol in [None] + ([] if args.joint_tolerance is None else [args.joint_tolerance]):
                _joint_reference_row(name, plan_tr, test_tr, N, G, R, args.joint_seconds, ref_x, base, tol)


def _joint_reference_row(name: str, plan_tr: Trace, test_tr: Trace, N: int, G: int, R: int, seconds: float,
                         ref_x: float, base: Layout, tolerance: float | None) -> None:
    """One row: `anneal_joint` per layer (G R copies per node), relative to cobalt's R=0 layout."""
    from ds_cobalt.planner.stage2 import node_loads

    src_node_T = plan_tr.source_ranks(N * G) // G
    slots = []
    for layer in range(plan_tr.num_layers):
        topk_TK = plan_tr.experts_LTK[layer]
        st = RoutingStats.from_topk(topk_TK, plan_tr.num_experts)
        owners, copies = anneal_joint(st, topk_TK, src_node_T, N, G * R, seconds / plan_tr.num_layers,
                                      tolerance=tolerance)
        holds = copies.copy()
        holds[owners, np.arange(owners.size)] = True
        slots.append(plan_gpus(owners, copies, node_loads(topk_TK, src_node_T, holds), G, R))
    layout = Layout(plan_tr.num_experts, N, G, np.stack(slots))
    m = simulate(test_tr, layout)["mean"]
    base_x = simulate(test_tr, base)["mean"]["cross_node_tokens_per_token"]
    x = m["cross_node_tokens_per_token"]
    bound = "node load unbounded" if tolerance is None else f"node load <= {1 + tolerance:.2f} mean"
    print(f"| {name} | joint-SA-reference ({seconds:.0f}s, {bound}; vs cobalt R=0) | {R} | {x:.3f} | "
          f"{x / base_x:.3f} | "
          f"{x / m['deepspeed_cross_node_pairs_per_token']:.3f} | {x / ref_x:.3f} | "
          f"{m['gpu_load_max_over_mean']:.3f} | {m['node_load_max_over_mean']:.3f} | {seconds:.0f} | - | - | - |",
          flush=True)


if __name__ == "__main__":
    main()
