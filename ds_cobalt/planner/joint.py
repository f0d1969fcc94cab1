"""Joint local search over owners and per-node traffic copies on one exact objective.

Legend: E experts, N nodes, M distinct top-k sets.

The objective is `ReplicaPartitionState.value` (expected remote nodes per token over the N source views, a
copy local in its node's view). Owner swaps (`refine_swaps` on the state) and copy moves (add a copy to a free
slot, or drop one copy of a node and take another) are scored exactly on the same state and alternate until
neither improves, so a copy move sees the current owners and an owner swap the current copies.

Node load model (sources uniform): a copy of e serves its node's tokens, `load_E / N`; the owner serves the
nodes without a copy, `load_E (1 - copies / N)`. Moves keep node loads within the bound (or do not raise the
maximum when it is above the bound already).
"""

from __future__ import annotations

import numpy as np

from .replicas import ReplicaPartitionState
from .stage1 import refine_swaps

__all__ = ["node_load_model", "refine_joint", "improve_copies", "swap_owners"]

_EPS = 1e-9


def _load_split(load_E: np.ndarray, copies_NE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The node load model: `[E]` load left to each owner, `load_E (1 - copies / N)`, and `[N]` load its
    copies serve on each node, `load_E / N` per copy."""
    N = copies_NE.shape[0]
    return load_E * (1.0 - copies_NE.sum(axis=0) / N), copies_NE @ (load_E / N)


def node_load_model(load_E: np.ndarray, node_of_E: np.ndarray, copies_NE: np.ndarray) -> np.ndarray:
    """`[N]` modelled node load: owners `load_E (1 - copies / N)`, each copy `load_E / N`."""
    owner_load_E, copy_load_N = _load_split(load_E, copies_NE)
    return np.bincount(node_of_E, weights=owner_load_E, minlength=copies_NE.shape[0]) + copy_load_N


def swap_owners(state: ReplicaPartitionState, load_E: np.ndarray, bound: float) -> None:
    """Stage 1's owner swaps (`refine_swaps`) in place, the state's copies counted local, node loads in the
    node load model within `bound` (or the starting maximum)."""
    owner_load_E, copy_load_N = _load_split(load_E, state.copies_NE())
    refine_swaps(state, owner_load_E, bound, candidates=64, base_load_N=copy_load_N, repair_checks=16)


def _load_ok(load_N: np.ndarray, delta: dict[int, float], bound: float) -> bool:
    """Whether `load_N` changed by `delta` (node -> change) stays within `max(bound, current max)`."""
    limit = max(bound, float(load_N.max())) + _EPS
    return all(load_N[n] + d <= limit for n, d in delta.items() if d > 0)


def _shift(s: int, owner: int, share: float, add: bool) -> dict[int, float]:
    """Modelled load change of adding (dropping) a copy on s of an expert owned by `owner`."""
    sign = 1.0 if add else -1.0
    return {s: sign * share, owner: -sign * share}


def improve_copies(state: ReplicaPartitionState, s: int, slots: int, load_E: np.ndarray, load_N: np.ndarray,
                   bound: float, fixed_E: np.ndarray, candidates: int = 6) -> bool:
    """Best-improvement copy moves on node s, in place (`load_N` updated): fill free slots (s holds fewer than
    `slots` copies) with the largest exact gain, then drop-one/take-one pairs while one improves. `fixed_E`:
    copies of s never dropped. Returns whether anything changed."""
    N = state.N
    changed = False
    while True:
        gain_E = state.copy_gains(s)
        owner_E = state.node_of_E
        copies_E = state.copies_NE()[s]
        held_E = copies_E & ~fixed_E
        addable_E = state.active_SE[s] & (owner_E != s)
        share_E = load_E / N
        adds = [int(f) for f in np.argsort(-np.where(addable_E, gain_E, -np.inf), kind="stable")[:candidates]
                if addable_E[f] and gain_E[f] > _EPS]
        # Step 1: a free slot takes the best add that fits the load bound.
        if copies_E.sum() < slots:
            f = next((f for f in adds if _load_ok(load_N, _shift(s, owner_E[f], share_E[f], True), bound)), -1)
            if f < 0:
                return changed
            _apply(state, load_N, s, f, share_E[f], add=True)
            changed = True
            continue
        # Step 2: a full node swaps its cheapest copies for the best adds (exact pair deltas).
        drops = [int(e) for e in np.argsort(-np.where(held_E, gain_E, -np.inf), kind="stable")[:candidates]
                 if held_E[e]]
        pairs = sorted(((gain_E[f] + gain_E[e], e, f) for e in drops for f in adds), key=lambda p: (-p[0], p[1], p[2]))
        for _, e, f in pairs:
            delta = _shift(s, owner_E[e], share_E[e], False)
            for n, d in _shift(s, owner_E[f], share_E[f], True).items():
                delta[n] = delta.get(n, 0.0) + d
            if _load_ok(load_N, delta, bound) and state.copy_move_delta(s, e, f) > _EPS:
                _apply(state, load_N, s, e, share_E[e], add=False)
                _apply(state, load_N, s, f, share_E[f], add=True)
                changed = True
                break
        else:
            return changed


def _apply(state: ReplicaPartitionState, load_N: np.ndarray, s: int, e: int, share: float, add: bool) -> None:
    for n, d in _shift(s, int(state.node_of_E[e]), share, add).items():
        load_N[n] += d
    state.toggle_copy(s, e)


def refine_joint(sets_MK: np.ndarray, count_M: np.ndarray, load_E: np.ndarray, node_of_E: np.ndarray,
                 copies_NE: np.ndarray, slots_per_node: int, *, fixed_NE: np.ndarray | None = None,
                 load_tolerance: float = 0.02, rounds: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(`[E]` owners, `[N, E]` bool copies) after alternating exact owner swaps and copy moves.

    Args:
        sets_MK, count_M: the top-k set histogram (the objective).
        load_E: `[E]` expert loads (node load model above).
        node_of_E: `[E]` starting owners.
        copies_NE: `[N, E]` bool starting copies (copies on the owner node are dropped).
        slots_per_node: copies a node may hold (its spare slots), `fixed_NE` included.
        fixed_NE: `[N, E]` bool copies never dropped (e.g. the hottest experts on every node; one on a node
            that becomes the expert's owner falls away).
    Node loads stay within `1 + load_tolerance` of the mean (or the starting maximum, if larger).
    """
    N, E = copies_NE.shape
    load_E = np.asarray(load_E, dtype=np.float64)
    fixed_NE = np.zeros((N, E), dtype=bool) if fixed_NE is None else np.asarray(fixed_NE, dtype=bool)
    copies_NE = (copies_NE | fixed_NE) & (node_of_E[None, :] != np.arange(N)[:, None])
    state = ReplicaPartitionState(sets_MK, count_M, node_of_E, copies_NE)
    bound = (1 + load_tolerance) * load_E.sum() / N
    for _ in range(rounds):
        # Step 1: owner swaps with the current copies counted as local.
        before = state.node_of_E.copy()
        swap_owners(state, load_E, bound)
        moved = not np.array_equal(before, state.node_of_E)
        _drop_owned_copies(state)
        # Step 2: copy moves on every node for the new owners (fixed copies on a new owner node fall away).
        load_N = node_load_model(load_E, state.node_of_E, state.copies_NE())
        changed = False
        for s in range(N):
            changed |= improve_copies(state, s, slots_per_node, load_E, load_N, bound, fixed_NE[s])
        if not (moved or changed):
            break
    return state.node_of_E.copy(), state.copies_NE()


def _drop_owned_copies(state: ReplicaPartitionState) -> None:
    """Clear copy flags left on an expert's owner node by swaps (such a copy is worth nothing and would
    come back, over the slot count, if the owner left again)."""
    s_C, e_C = np.nonzero(~state.active_SE & (state.node_of_E[None, :] == np.arange(state.N)[:, None]))
    for s, e in zip(s_C, e_C):
        state.toggle_copy(int(s), int(e))
