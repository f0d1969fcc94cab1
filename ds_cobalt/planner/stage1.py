"""Stage 1, inter-node placement (periodic): which node owns each expert.

Legend: M distinct top-k sets, K top-k, E experts, N nodes.

Entry point `plan_nodes`: minimise connectivity (see objective.py) of the weighted top-k sets with exactly
E / N experts per node and node load (sum of `load_E`) within `(1 + load_tolerance) * mean`, then relabel
nodes to keep as many experts in place as possible. Partitioners: Mt-KaHyPar on the hypergraph of distinct
sets (when installed, single-threaded so that it is deterministic) and numpy seeds (co-activation greedy,
pairwise cut, METIS when installed), each refined by exact pairwise swaps. The refinement's inner loops run
compiled (`_stage1_kernels`, numba).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from .objective import PartitionState, connectivity

__all__ = [
    "plan_nodes", "relabel_to_current", "refine_swaps", "greedy_coact_partition", "kahypar_partition",
    "metis_partition",
]


def _equal_fill(order_E: np.ndarray, E: int, N: int) -> np.ndarray:
    node_of_E = np.empty(E, dtype=np.int64)
    node_of_E[order_E] = np.arange(E) // (E // N)
    return node_of_E


def greedy_coact_partition(load_E: np.ndarray, coact_EE: np.ndarray, nodes: int) -> np.ndarray:
    """`[E]` node per expert: grow nodes one at a time from the hottest free expert by co-activation.

    Step 1: seed node n with the hottest free expert (first maximum). Step 2: add the free expert most
    co-activated with the node so far (affinity + 1e-9 load, first maximum) until it has E / N. Compiled
    (`_stage1_kernels.greedy_coact`).
    """
    from . import _stage1_kernels as _kernels

    return _kernels.greedy_coact(np.ascontiguousarray(load_E, dtype=np.float64),
                                 np.ascontiguousarray(coact_EE, dtype=np.float64), int(nodes))


def kahypar_partition(
    sets_MK: np.ndarray, count_M: np.ndarray, num_experts: int, nodes: int, seed: int = 0
) -> np.ndarray | None:
    """`[E]` node per expert from Mt-KaHyPar (km1, exactly E / N vertices per block); None if unavailable."""
    try:
        import mtkahypar
    except ImportError:
        return None
    E, N = num_experts, nodes
    keep = (sets_MK >= 0).sum(axis=1) >= 2
    edges = [row[row >= 0].tolist() for row in sets_MK[keep]]
    if not edges:
        return None
    # Integer weights: scale counts so that light sets keep some weight.
    w = count_M[keep]
    weights = np.maximum(1, np.round(w / max(w.max(), 1e-12) * 10000)).astype(np.int64).tolist()
    ctx_init = _kahypar_initializer(mtkahypar)
    mtkahypar.set_seed(seed if -(1 << 31) <= seed < (1 << 31) else seed % (1 << 31))  # a C int there
    ctx = ctx_init.context_from_preset(mtkahypar.PresetType.DEFAULT)
    ctx.set_partitioning_parameters(N, 0.0, mtkahypar.Objective.KM1)
    ctx.logging = False
    ctx.set_individual_target_block_weights([E // N] * N)
    hg = ctx_init.create_hypergraph(ctx, E, len(edges), edges, [1] * E, weights)
    part = np.asarray(hg.partition(ctx).get_partition(), dtype=np.int64)
    return _rebalance_counts(part, E, N)


def metis_partition(load_E: np.ndarray, coact_EE: np.ndarray, nodes: int) -> np.ndarray | None:
    """`[E]` node per expert from METIS k-way on the co-activation graph, vertex weight = load (counts
    repaired to E / N after); None when pymetis is not installed (it is an optional seed)."""
    try:
        import pymetis
    except ImportError:
        return None
    E = load_E.size
    w = np.rint(coact_EE / max(float(coact_EE.max()), 1e-12) * 100000).astype(np.int64)
    np.fill_diagonal(w, 0)
    rows, cols = np.nonzero(w)
    if rows.size == 0:
        return None
    xadj = np.searchsorted(rows, np.arange(E + 1))
    vw = np.maximum(1, np.rint(load_E / max(float(load_E.max()), 1e-12) * 1000)).astype(np.int64)
    _, part = pymetis.part_graph(nodes, adjacency=pymetis.CSRAdjacency(xadj, cols), vweights=vw,
                                 eweights=w[rows, cols], options=pymetis.Options(ufactor=1, seed=0))
    return _rebalance_counts(np.asarray(part, dtype=np.int64), E, nodes)


_KAHYPAR: list = []


def _kahypar_initializer(mtkahypar):  # noqa: ANN001, ANN202 - module object
    # One thread: with several, Mt-KaHyPar returns different partitions from run to run for the same seed (the
    # planner must be deterministic); the planner runs on one core anyway.
    if not _KAHYPAR:
        _KAHYPAR.append(mtkahypar.initialize(1, False))
    return _KAHYPAR[0]


def _rebalance_counts(node_of_E: np.ndarray, E: int, N: int) -> np.ndarray:
    """Move experts from over-full to under-full nodes so every node has exactly E / N."""
    per = E // N
    node_of_E = node_of_E.copy()
    count_N = np.bincount(node_of_E, minlength=N)
    for n in np.nonzero(count_N > per)[0]:
        extra = np.nonzero(node_of_E == n)[0][per:]
        for e in extra:
            target = int(np.argmin(count_N))
            node_of_E[e] = target
            count_N[target] += 1
            count_N[n] -= 1
    return node_of_E


def refine_swaps(
    state: PartitionState,
    load_E: np.ndarray,
    max_node_load: float,
    max_rounds: int = 200,
    candidates: int | None = None,
    base_load_N: np.ndarray | None = None,
    repair_checks: int | None = None,
) -> None:
    """Pairwise-swap refinement on the exact objective, in place (also repairs node-load violations).

    `base_load_N`: `[N]` load each node carries besides its owners' `load_E` (counted in the bound).
    `repair_checks`: exact checks per node-load repair step (None = every candidate swap).
    Each round ranks swaps (a -> best node B, b in B -> a's node) by their move gains, checks the
    best `candidates` exactly and applies every improving, load-feasible one; stops when none improves.
    States with `swap_deltas`/`try_swaps` (`PartitionState`, `ReplicaPartitionState`) run the checks compiled;
    any other state with `move_gains`/`swap_delta`/`apply_swap` runs the same steps in Python.
    """
    N = state.N
    load_E = np.ascontiguousarray(load_E, dtype=np.float64)
    load_N = np.bincount(state.node_of_E, weights=load_E, minlength=N)
    if base_load_N is not None:
        load_N += base_load_N  # load a node carries whatever it owns (e.g. copies of other nodes' experts)
    cand = candidates if candidates is not None else max(16, state.E)
    cached: list = []
    repairs = 0
    for _ in range(max_rounds):
        # Step 1: repair node load first (swap a hot expert of the fullest node with a cold one).
        if load_N.max() > max_node_load + 1e-9:
            repairs += 1
            if repairs % 8 == 0:
                cached.clear()  # refresh the ranking gains every 8 repairs
            if not _repair_step(state, load_E, load_N, max_node_load, repair_checks, cached):
                # Unreachable bound from here: keep the current maximum as the bound.
                max_node_load = float(load_N.max())
            continue
        # Step 2: rank candidate swaps (a to its best node B, back the member of B best at a's node) by the
        # sum of the two single-move gains; ties: larger a first.
        gain_EN = state.move_gains()
        best_B = np.argmax(gain_EN, axis=1)
        node = state.node_of_E
        a_C = np.argsort(-gain_EN[np.arange(state.E), best_B])[:cand]
        b_C = _back_members(gain_EN, node, N)[best_B[a_C], node[a_C]]
        score_C = gain_EN[a_C, best_B[a_C]] + gain_EN[b_C, node[a_C]]
        order = np.lexsort((-a_C, -score_C))
        # Step 3: exact check, apply improving and feasible swaps (each on the current state).
        if not _try_swaps(state, a_C[order], b_C[order], load_E, load_N, max_node_load):
            break


def _back_members(gain_EN: np.ndarray, node_of_E: np.ndarray, N: int) -> np.ndarray:
    """`[N, N]`: the member of node B with the largest gain at node A (first in index order)."""
    from . import _stage1_kernels as _kernels

    return _kernels.best_back_members(np.ascontiguousarray(gain_EN), node_of_E, N)


def _try_swaps(state: PartitionState, a_C: np.ndarray, b_C: np.ndarray, load_E: np.ndarray, load_N: np.ndarray,
               bound: float) -> bool:
    """Step 3 of `refine_swaps` (compiled when the state has `try_swaps`)."""
    if hasattr(state, "try_swaps"):
        return state.try_swaps(a_C, b_C, load_E, load_N, bound)
    node = state.node_of_E
    improved = False
    touched: set[int] = set()
    for a, b in zip(a_C.tolist(), b_C.tolist()):
        if a in touched or b in touched:
            continue
        A, B = node[a], node[b]
        dA = load_E[b] - load_E[a]
        if max(load_N[A] + dA, load_N[B] - dA) > bound + 1e-9:
            continue
        if state.swap_delta(a, b) > 1e-9:
            state.apply_swap(a, b)
            load_N[A] += dA
            load_N[B] -= dA
            touched.update((a, b))
            improved = True
    return improved


def _repair_step(state: PartitionState, load_E: np.ndarray, load_N: np.ndarray, max_node_load: float,
                 exact_checks: int | None = None, gains: list | None = None) -> bool:
    """One swap lowering the fullest node's load, least damaging to the objective. False if none.

    Candidate swaps: one of the 8 hottest experts a of the fullest node A with one of the 8 coldest experts
    colder than a of one of the 8 lightest nodes B, kept when B stays under the bound; order B, a, b (ascending
    load, ties by index). All are scored exactly with `swap_delta`, or, with `exact_checks`, only the best
    `exact_checks` after ranking by the two single-move gains (for states whose swap_delta is costly). `gains`:
    a one-item cache of the move gains ([] = compute and store); they only rank candidates, so a slightly stale
    matrix is fine. The first best pair wins.
    """
    from . import _stage1_kernels as _kernels

    node = state.node_of_E
    A = int(np.argmax(load_N))
    hot = np.nonzero(node == A)[0]
    hot = hot[np.argsort(-load_E[hot])][:8]
    light = np.argsort(load_N)[: max(1, min(state.N - 1, 8))].astype(np.int64)
    a_C, b_C = _kernels.repair_pairs(node, load_E, load_N, hot.astype(np.int64), light, A, float(max_node_load))
    if a_C.size == 0:
        return False
    if exact_checks is not None and a_C.size > exact_checks:
        if gains is None or not gains:
            gain_EN = state.move_gains()
            if gains is not None:
                gains.append(gain_EN)
        else:
            gain_EN = gains[0]
        approx = gain_EN[a_C, node[b_C]] + gain_EN[b_C, node[a_C]]
        keep = np.argsort(-approx, kind="stable")[:exact_checks]
        a_C, b_C = a_C[keep], b_C[keep]
    if hasattr(state, "swap_deltas"):
        delta_C = state.swap_deltas(a_C, b_C)
    else:
        delta_C = np.array([state.swap_delta(int(a), int(b)) for a, b in zip(a_C, b_C)])
    i = int(np.argmax(delta_C))
    a, b = int(a_C[i]), int(b_C[i])
    d = load_E[a] - load_E[b]
    load_N[node[a]] -= d
    load_N[node[b]] += d
    state.apply_swap(a, b)
    return True


def relabel_to_current(node_of_E: np.ndarray, current_node_of_E: np.ndarray, nodes: int) -> np.ndarray:
    """Permute node labels to maximise experts staying on their current node (Hungarian matching)."""
    overlap_NN = np.zeros((nodes, nodes), dtype=np.int64)
    np.add.at(overlap_NN, (node_of_E, current_node_of_E), 1)
    new, old = linear_sum_assignment(-overlap_NN)
    label = np.empty(nodes, dtype=np.int64)
    label[new] = old
    return label[node_of_E]


KAHYPAR_AUTO_MAX_PINS = 100_000  # above this, "auto" skips Mt-KaHyPar (seconds on 2 cores, rarely better)


def pairwise_partition(load_E: np.ndarray, coact_EE: np.ndarray, nodes: int, max_node_load: float) -> np.ndarray:
    """`[E]` node per expert minimising the pairwise co-activation cut (greedy seed + swap refinement)."""
    i, j = np.nonzero(np.triu(coact_EE, 1))
    state = PartitionState(np.stack([i, j], axis=1).astype(np.int64), coact_EE[i, j].astype(np.float64),
                           greedy_coact_partition(load_E, coact_EE, nodes), nodes)
    refine_swaps(state, load_E, max_node_load)
    return state.node_of_E


def plan_nodes(
    load_E: np.ndarray,
    coact_EE: np.ndarray,
    sets_MK: np.ndarray,
    count_M: np.ndarray,
    nodes: int,
    *,
    load_tolerance: float = 0.05,
    current_node_of_E: np.ndarray | None = None,
    partitioner: str = "auto",
    seed: int = 0,
) -> np.ndarray:
    """Stage 1: `[E]` int64 node owning each expert (E / N per node), see module docstring.

    `partitioner`: "auto" (best of every available seed after refinement), "fast" (auto without Mt-KaHyPar),
    "kahypar", "greedy", "none"
    (refine the current / contiguous placement only).
    """
    E, N = load_E.size, nodes
    if E % N:
        raise ValueError(f"num_experts={E} is not divisible by nodes={N}")
    if partitioner not in ("auto", "fast", "kahypar", "greedy", "none"):
        raise ValueError(f"partitioner must be auto, fast, kahypar, greedy or none, got {partitioner!r}")
    if N == 1:
        return np.zeros(E, dtype=np.int64)
    load_E = np.asarray(load_E, dtype=np.float64)
    max_node_load = (1.0 + load_tolerance) * load_E.sum() / N
    if E // N == 1:
        max_node_load = np.inf  # one expert per node: nothing to balance

    # Step 1: candidate seeds.
    seeds: list[np.ndarray] = []
    if current_node_of_E is not None:
        seeds.append(np.asarray(current_node_of_E, dtype=np.int64))
    pins = int((sets_MK >= 0).sum())
    if partitioner == "kahypar" or (partitioner == "auto" and pins <= KAHYPAR_AUTO_MAX_PINS):
        part = kahypar_partition(sets_MK, count_M, E, N, seed)
        if part is not None:
            seeds.append(part)
        elif partitioner == "kahypar":
            raise ValueError("partitioner='kahypar' needs the mtkahypar package (pip install mtkahypar)")
    if partitioner in ("auto", "fast", "greedy"):
        seeds.append(greedy_coact_partition(load_E, coact_EE, N))
    if partitioner in ("auto", "fast"):
        seeds.append(pairwise_partition(load_E, coact_EE, N, max_node_load))
        part = metis_partition(load_E, coact_EE, N)  # optional (pymetis); milliseconds
        if part is not None:
            seeds.append(part)
    if not seeds:
        seeds.append(np.arange(E) // (E // N))

    # Step 2: exact swap refinement of each seed, keep the best feasible.
    best: tuple[float, np.ndarray] | None = None
    shared = PartitionState(sets_MK, count_M, seeds[0], N)
    for i, node_of_E in enumerate(seeds):
        state = shared if i == 0 else shared.with_nodes(node_of_E)
        refine_swaps(state, load_E, max_node_load)
        load_N = np.bincount(state.node_of_E, weights=load_E, minlength=N)
        value = state.value() + 1e6 * max(0.0, load_N.max() / max(max_node_load, 1e-12) - 1.0) * count_M.sum()
        if best is None or value < best[0] - 1e-9:
            best = (value, state.node_of_E.copy())
    assert best is not None
    node_of_E = best[1]

    # Step 3: relabel nodes to keep experts in place.
    if current_node_of_E is not None:
        node_of_E = relabel_to_current(node_of_E, np.asarray(current_node_of_E), N)
    assert connectivity(sets_MK, count_M, node_of_E) >= 0
    return node_of_E
