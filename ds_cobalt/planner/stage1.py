"""Stage 1, inter-node placement (periodic): which node owns each expert.

Legend: M distinct top-k sets, K top-k, E experts, N nodes.

Entry point `plan_nodes`: minimise connectivity (see objective.py) of the weighted top-k sets with exactly
E / N experts per node and node load (sum of `load_E`) within `(1 + load_tolerance) * mean`, then relabel
nodes to keep as many experts in place as possible. Partitioners: Mt-KaHyPar on the hypergraph of distinct
sets (when installed) and a numpy seed (co-activation greedy), each refined by exact pairwise swaps.
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
    """`[E]` node per expert: grow nodes one at a time from the hottest free expert by co-activation."""
    E, N = load_E.size, nodes
    per = E // N
    free = np.ones(E, dtype=bool)
    node_of_E = np.empty(E, dtype=np.int64)
    for n in range(N):
        # Step 1: seed with the hottest free expert.
        seed = int(np.argmax(np.where(free, load_E, -1)))
        members = [seed]
        free[seed] = False
        affinity_E = coact_EE[seed].astype(np.float64).copy()
        # Step 2: add the free expert most co-activated with the node so far.
        while len(members) < per:
            e = int(np.argmax(np.where(free, affinity_E + 1e-9 * load_E, -np.inf)))
            members.append(e)
            free[e] = False
            affinity_E += coact_EE[e]
        node_of_E[members] = n
    return node_of_E


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
    mtkahypar.set_seed(seed)
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
    if not _KAHYPAR:
        _KAHYPAR.append(mtkahypar.initialize(2, False))
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
    """
    N = state.N
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
        # Step 2: rank candidate swaps by the sum of the two single-move gains.
        gain_EN = state.move_gains()
        best_B = np.argmax(gain_EN, axis=1)
        node = state.node_of_E
        score = []
        for a in np.argsort(-gain_EN[np.arange(state.E), best_B])[:cand]:
            B = best_B[a]
            members = np.nonzero(node == B)[0]
            back_gain_E = gain_EN[members, node[a]]
            b = members[int(np.argmax(back_gain_E))]
            score.append((gain_EN[a, B] + gain_EN[b, node[a]], int(a), int(b)))
        score.sort(reverse=True)
        improved = False
        touched: set[int] = set()
        # Step 3: exact check, apply improving and feasible swaps (each on the current state).
        for _, a, b in score:
            if a in touched or b in touched:
                continue
            A, B = node[a], node[b]
            dA = load_E[b] - load_E[a]
            if max(load_N[A] + dA, load_N[B] - dA) > max_node_load + 1e-9:
                continue
            if state.swap_delta(a, b) > 1e-9:
                state.apply_swap(a, b)
                load_N[A] += dA
                load_N[B] -= dA
                touched.update((a, b))
                improved = True
        if not improved:
            break


def _repair_step(state: PartitionState, load_E: np.ndarray, load_N: np.ndarray, max_node_load: float,
                 exact_checks: int | None = None, gains: list | None = None) -> bool:
    """One swap lowering the fullest node's load, least damaging to the objective. False if none.

    Candidate swaps: a hot expert of the fullest node A with a colder one of a light node B that keeps B
    under the bound. All are scored exactly with `swap_delta`, or, with `exact_checks`, only the best
    `exact_checks` after ranking by the two single-move gains (for states whose swap_delta is costly).
    `gains`: a one-item cache of the move gains
    ([] = compute and store); they only rank candidates, so a slightly stale matrix is fine.
    """
    node = state.node_of_E
    A = int(np.argmax(load_N))
    hot = np.nonzero(node == A)[0]
    hot = hot[np.argsort(-load_E[hot])][:8]
    light = [int(B) for B in np.argsort(load_N)[: max(1, min(state.N - 1, 8))] if B != A]
    pairs = []
    for B in light:
        cold = np.nonzero(node == B)[0]
        for a in hot:
            ok = cold[load_E[cold] < load_E[a]]
            ok = ok[np.argsort(load_E[ok])][:8]
            for b in ok:
                d = load_E[a] - load_E[b]
                if load_N[B] + d <= max(max_node_load, load_N[A] - d) + 1e-9:
                    pairs.append((int(a), int(b)))
    if not pairs:
        return False
    if exact_checks is not None and len(pairs) > exact_checks:
        if gains is None or not gains:
            gain_EN = state.move_gains()
            if gains is not None:
                gains.append(gain_EN)
        else:
            gain_EN = gains[0]
        approx = np.array([gain_EN[a, node[b]] + gain_EN[b, node[a]] for a, b in pairs])
        pairs = [pairs[i] for i in np.argsort(-approx, kind="stable")[:exact_checks]]
    best: tuple[float, int, int] | None = None
    for a, b in pairs:
        value = state.swap_delta(a, b)
        if best is None or value > best[0]:
            best = (value, a, b)
    assert best is not None
    _, a, b = best
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
    for node_of_E in seeds:
        state = PartitionState(sets_MK, count_M, node_of_E, N)
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
