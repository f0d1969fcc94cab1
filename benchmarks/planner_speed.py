"""Planner speed: stage 1 (E=256, k=8, 64 nodes x 8 GPUs, 64k tokens), stage 2 + task assignment per
layer (8 GPUs/node, 16k tokens per GPU), and the `cobalt` policy for one layer (E=256, k=8, 8 nodes x 8 GPUs,
1 spare slot, 20k tokens). Prints wall times measured in this run (numpy, this machine; best of 3 except
stage 1 and cobalt).

    python benchmarks/planner_speed.py
"""

from __future__ import annotations

import time

import numpy as np

from ds_cobalt.planner.assign import assign_tasks
from ds_cobalt.planner.policies import plan_layout
from ds_cobalt.planner.stage1 import plan_nodes
from ds_cobalt.planner.stage2 import plan_gpus
from ds_cobalt.planner.stats import RoutingStats
from ds_cobalt.sim.replay import refresh_spares
from ds_cobalt.sim.synth import synth_trace


def _time(fn, repeat: int = 3) -> float:
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    # Stage 1.
    tr = synth_trace(num_experts=256, top_k=8, num_tokens=65536, gini=0.4, clustering=0.6, seed=0)
    t0 = time.perf_counter()
    st = RoutingStats.from_topk(tr.experts_LTK[0], 256)
    t_stats = time.perf_counter() - t0
    for part in ("greedy", "kahypar", "auto"):
        t = _time(lambda part=part: plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 64, partitioner=part), 1)
        print(f"stage 1 ({part:7s}) E=256 k=8 N=64, 64k tokens: {t * 1e3:8.1f} ms  (stats {t_stats * 1e3:.0f} ms)")

    # Stage 2 + assignment: one node of 8 GPUs, 16k tokens per GPU -> 128k tokens, 8 nodes total.
    E, N, G, R, T = 256, 8, 8, 1, 8 * 16384
    tr = synth_trace(num_experts=E, top_k=8, num_tokens=T, gini=0.4, clustering=0.6, seed=1)
    topk = tr.experts_LTK[0]
    st = RoutingStats.from_topk(topk, E)
    node_of_E = plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, N, partitioner="greedy")
    load_NE = np.zeros((N, E))
    load_NE[node_of_E, np.arange(E)] = st.load_E
    slots = plan_gpus(node_of_E, np.zeros((N, E), bool), load_NE, G, R)
    keep = np.zeros_like(slots, dtype=bool)
    t2 = _time(lambda: refresh_spares(slots, keep, st.load_E, G, E))
    # Tokens of one node's 8 GPUs (what the node's ranks assign in one step).
    src = np.repeat(np.arange(G), T // G)
    ta = _time(lambda: assign_tasks(topk, src, slots, G))
    one_gpu = _time(lambda: assign_tasks(topk[: T // G], src[: T // G], slots, G))
    print(f"stage 2 (refresh spares, 8 nodes x 8 GPUs, R=1): {t2 * 1e3:8.1f} ms per layer")
    print(f"assign_tasks, 128k tokens (8 GPUs x 16k):        {ta * 1e3:8.1f} ms per layer")
    print(f"assign_tasks, 16k tokens (one GPU):              {one_gpu * 1e3:8.1f} ms per layer")

    # The cobalt policy (owners and replicas together), one layer.
    tr = synth_trace(num_experts=256, top_k=8, num_tokens=20000, gini=0.5, clustering=0.7, seed=7)
    t_co = _time(lambda: plan_layout(tr, 8, 8, 1, "cobalt"), 1)
    print(f"cobalt policy, E=256 k=8 8x8 R=1, 20k tokens:    {t_co:8.2f} s per layer")


if __name__ == "__main__":
    main()
