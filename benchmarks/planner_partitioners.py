"""Stage 1 seeds compared: METIS (pymetis) and KaHIP (kaffpa) on the pairwise co-activation graph against
what `plan_nodes` uses (co-activation greedy, pairwise-cut greedy + swaps, Mt-KaHyPar km1 on the top-k sets).

Every seed is scored raw and after the same exact swap refinement (`refine_swaps`, node load within 5 %),
as expected remote nodes per token on the planning half (the stage 1 objective) and as cross-node tokens
per token on the held-out half (GPUs packed by stage 2, no spare slots). Optional packages are skipped
when missing (`pip install pymetis==2025.2.2 kahip==3.25`).

    python benchmarks/planner_partitioners.py
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from ds_cobalt.planner.layout import Layout
from ds_cobalt.planner.objective import PartitionState, expected_remote_nodes
from ds_cobalt.planner.stage1 import (
    _rebalance_counts,
    greedy_coact_partition,
    kahypar_partition,
    pairwise_partition,
    refine_swaps,
)
from ds_cobalt.planner.stage2 import plan_gpus
from ds_cobalt.planner.stats import RoutingStats
from ds_cobalt.sim.metrics import simulate
from ds_cobalt.sim.synth import synth_trace

CASES = [  # name, E, K, nodes, gpus/node, tokens, gini, clustering (same as planner_quality.py)
    ("synth-E64-k6-4x4", 64, 6, 4, 4, 40000, 0.4, 0.6),
    ("synth-E128-k8-4x8", 128, 8, 4, 8, 40000, 0.3, 0.5),
    ("synth-E256-k8-8x8", 256, 8, 8, 8, 40000, 0.5, 0.7),
]


def _csr(coact_EE: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """xadj, adjncy, integer edge weights (scaled so the lightest edge keeps weight >= 1)."""
    E = coact_EE.shape[0]
    w = np.rint(coact_EE / max(coact_EE.max(), 1e-12) * 100000).astype(np.int64)
    np.fill_diagonal(w, 0)
    rows, cols = np.nonzero(w)
    xadj = np.searchsorted(rows, np.arange(E + 1))
    return xadj, cols, w[rows, cols]


def metis_seed(coact_EE: np.ndarray, nodes: int, load_E: np.ndarray | None = None) -> np.ndarray | None:
    """METIS k-way on the co-activation graph; with `load_E`, vertex weight = load (counts repaired after)."""
    try:
        import pymetis
    except ImportError:
        return None
    xadj, adjncy, ew = _csr(coact_EE)
    opts = pymetis.Options(ufactor=1, seed=0)
    vw = None
    if load_E is not None:
        vw = np.maximum(1, np.rint(load_E / max(load_E.max(), 1e-12) * 1000)).astype(np.int64)
    _, part = pymetis.part_graph(nodes, xadj=xadj, adjncy=adjncy, eweights=ew, vweights=vw, options=opts)
    return _rebalance_counts(np.asarray(part, dtype=np.int64), coact_EE.shape[0], nodes)


def kahip_seed(coact_EE: np.ndarray, nodes: int) -> np.ndarray | None:
    try:
        import kahip
    except ImportError:
        return None
    xadj, adjncy, ew = _csr(coact_EE)
    E = coact_EE.shape[0]
    _, part = kahip.kaffpa([1] * E, xadj.tolist(), ew.tolist(), adjncy.tolist(), nodes, 0.0, True, 0, kahip.STRONG)
    return _rebalance_counts(np.asarray(part, dtype=np.int64), E, nodes)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    print("| trace | seed | seed s | raw remote/token (plan) | refined (plan) | refined held-out tok/tok |")
    print("|---|---|---|---|---|---|")
    for name, E, K, N, G, T, g, c in CASES:
        tr = synth_trace(num_experts=E, top_k=K, num_tokens=T, gini=g, clustering=c, seed=7)
        perm = np.random.default_rng(0).permutation(T)
        plan_tr, test_tr = tr.select_tokens(np.sort(perm[: T // 2])), tr.select_tokens(np.sort(perm[T // 2 :]))
        st = RoutingStats.from_topk(plan_tr.experts_LTK[0], E)
        load_E = st.load_E.astype(np.float64)
        bound = 1.05 * load_E.sum() / N
        seeds = [
            ("coact greedy", greedy_coact_partition, (load_E, st.coact_EE, N)),
            ("pairwise cut (greedy+swaps)", pairwise_partition, (load_E, st.coact_EE, N, bound)),
            ("mt-kahypar km1 (sets)", kahypar_partition, (st.sets_MK, st.count_M, E, N)),
            ("metis (coact graph)", metis_seed, (st.coact_EE, N)),
            ("metis (load-weighted vertices)", metis_seed, (st.coact_EE, N, load_E)),
            ("kahip strong (coact graph)", kahip_seed, (st.coact_EE, N)),
        ]
        for label, fn, args in seeds:
            t0 = time.perf_counter()
            part = fn(*args)
            dt = time.perf_counter() - t0
            if part is None:
                print(f"| {name} | {label} | - | not installed | - | - |")
                continue
            raw = expected_remote_nodes(st.sets_MK, st.count_M, part, N)
            state = PartitionState(st.sets_MK, st.count_M, part, N)
            refine_swaps(state, load_E, bound)
            refined = expected_remote_nodes(st.sets_MK, st.count_M, state.node_of_E, N)
            load_NE = np.zeros((N, E))
            load_NE[state.node_of_E, np.arange(E)] = load_E
            slots = plan_gpus(state.node_of_E, np.zeros((N, E), bool), load_NE, G, 0)
            held = simulate(test_tr, Layout(E, N, G, slots[None]))["mean"]["cross_node_tokens_per_token"]
            print(f"| {name} | {label} | {dt:.2f} | {raw:.3f} | {refined:.3f} | {held:.3f} |", flush=True)


if __name__ == "__main__":
    main()
