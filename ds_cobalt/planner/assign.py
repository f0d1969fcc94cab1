"""Communication-aware task assignment: pick a physical replica for every (token, expert) pair.

Legend: T tokens, K top-k, E logical experts, N nodes, G GPUs per node, W = N * G ranks, S slots per rank,
P pending (token, expert) pairs.

`assign_tasks` is the numpy specification of the runtime's gating post-processor (the torch port must
agree with it exactly). For each token it
1. serves every expert its own node holds locally,
2. takes experts held by exactly one node from that node (forced: any solution must visit it),
3. serves experts held by several nodes from a node the token already visits, if any,
4. covers the rest with as few new nodes as possible (greedy set cover, then an exact search for the
   rare tokens where greedy needs 3 or more new nodes), so the number of distinct remote nodes per
   token is minimal for the layout's node coverage;
5. inside the chosen node, splits the tokens of a replicated expert among its replicas to even out GPU
   loads (number of (token, expert) pairs per rank, exact for this batch): groups largest first, each
   water-filled over its replicas' ranks given the load placed so far (a greedy fill, not an optimum: a
   later group can leave a rank above what moving an earlier group's tokens would reach).
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["assign_tasks", "layout_tables", "remote_nodes_per_token"]


def layout_tables(slots_WS: np.ndarray, gpus_per_node: int, num_experts: int) -> dict[str, np.ndarray]:
    """Lookup tables of one layer's layout.

    Returns `holds_NE` (bool, node holds a copy), `slot_of_WE` (int64 first slot of rank r holding e,
    -1 = none), `replicas_NE` (int64 copies of e on node n).
    """
    slots = np.asarray(slots_WS, dtype=np.int64)
    W, S = slots.shape
    N = W // gpus_per_node
    slot_of_WE = np.full((W, num_experts), -1, dtype=np.int64)
    rank_W = np.repeat(np.arange(W), S)
    slot_S = np.tile(np.arange(S), W)
    flat = slots.reshape(-1)
    keep = flat >= 0
    # Reverse order so the first slot holding e wins.
    r, s, e = rank_W[keep][::-1], slot_S[keep][::-1], flat[keep][::-1]
    slot_of_WE[r, e] = s
    held_WE = slot_of_WE >= 0
    replicas_NE = held_WE.reshape(N, gpus_per_node, num_experts).sum(axis=1).astype(np.int64)
    return {"holds_NE": replicas_NE > 0, "slot_of_WE": slot_of_WE, "replicas_NE": replicas_NE}


def _check_inputs(
    topk_ids_TK: np.ndarray, source_rank_T: np.ndarray, slots_WS: np.ndarray, gpus_per_node: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    topk = np.asarray(topk_ids_TK)
    src = np.asarray(source_rank_T)
    slots = np.asarray(slots_WS)
    if topk.ndim != 2 or not np.issubdtype(topk.dtype, np.integer):
        raise ValueError(f"assign_tasks: topk_ids_TK must be an integer array [T, K], got {topk.dtype} {topk.shape}")
    if src.shape != (topk.shape[0],) or not np.issubdtype(src.dtype, np.integer):
        raise ValueError(f"assign_tasks: source_rank_T must be an integer array [T={topk.shape[0]}], got {src.shape}")
    if slots.ndim != 2 or not np.issubdtype(slots.dtype, np.integer):
        raise ValueError(f"assign_tasks: slots_WS must be an integer array [W, S], got {slots.dtype} {slots.shape}")
    W = slots.shape[0]
    if gpus_per_node < 1 or W % gpus_per_node:
        raise ValueError(f"assign_tasks: gpus_per_node={gpus_per_node} does not divide the {W} ranks")
    if src.size and (int(src.min()) < 0 or int(src.max()) >= W):
        raise ValueError(f"assign_tasks: source_rank_T holds ranks outside [0, {W})")
    # The ids themselves (>= -1, each held by some slot) are checked in the first assignment pass, which
    # then raises through `_id_error`; E here counts the experts the layout holds.
    E = int(slots.max(initial=-1)) + 1
    return topk, src.astype(np.int64, copy=False), slots.astype(np.int64, copy=False), E


def _id_error(topk: np.ndarray, slots: np.ndarray) -> ValueError:
    """The error for ids below -1 or held by no slot (checked in that order)."""
    if int(topk.min()) < -1:
        return ValueError("assign_tasks: topk_ids_TK holds ids below -1")
    E = int(max(slots.max(initial=-1), topk.max(initial=-1))) + 1
    held = np.zeros(E + 1, dtype=bool)  # index E stands for -1 (always "held")
    held[slots[slots >= 0]] = True
    held[E] = True
    wanted = topk[topk >= 0]
    missing = np.unique(wanted[~held[wanted]])
    return ValueError(f"assign_tasks: expert(s) {missing[:8].tolist()} are chosen but held by no slot")


def _tie_break(num_rows: int, N: int, row_ids: np.ndarray) -> np.ndarray:
    """`[P, N]` float in [0, 0.5): a deterministic per-token preference that spreads ties over nodes."""
    order = (np.arange(N)[None, :] - (row_ids[:, None] * 7919)) % N
    return 0.5 * order / N


def _exact_cover(masks: list[int], full: int, upper: int) -> list[int] | None:
    """Smallest list (< upper) of indices into `masks` whose OR is `full`, else None."""
    uniq: dict[int, int] = {}
    for i, m in enumerate(masks):
        if m and m not in uniq:
            uniq[m] = i
    # Drop masks contained in another one: they never help a minimum cover.
    maximal = [m for m in uniq if not any(o != m and (m | o) == o for o in uniq)]
    for size in range(1, upper):
        for combo in itertools.combinations(maximal, size):
            acc = 0
            for m in combo:
                acc |= m
            if acc == full:
                return [uniq[m] for m in combo]
    return None


def assign_tasks(
    topk_ids_TK: np.ndarray,
    source_rank_T: np.ndarray,
    slots_WS: np.ndarray,
    gpus_per_node: int,
    *,
    exact: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Choose the replica serving every (token, expert) pair.

    Args:
        topk_ids_TK: `[T, K]` int, logical expert ids, -1 = dropped.
        source_rank_T: `[T]` int, global rank where each token lives.
        slots_WS: `[W, S]` int, one layer of a layout (logical expert per slot, -1 = empty).
        gpus_per_node: G; rank r is on node r // G.
        exact: search exactly for a smaller node cover where greedy needs >= 3 new nodes.

    Returns:
        `(dest_rank_TK, dest_slot_TK)`, int64 `[T, K]`; -1 where the id is -1.
        Pure and deterministic: ties are broken by token index, never by randomness.
    """
    topk, src_T, slots, E = _check_inputs(topk_ids_TK, source_rank_T, slots_WS, gpus_per_node)
    T, K = topk.shape
    W = slots.shape[0]
    G = gpus_per_node
    N = W // G
    tables = layout_tables(slots, G, E)
    holds_NE, slot_of_WE, replicas_NE = tables["holds_NE"], tables["slot_of_WE"], tables["replicas_NE"]
    if T == 0:
        return np.full((T, K), -1, dtype=np.int64), np.full((T, K), -1, dtype=np.int64)

    # Steps 1-2 in one lookup: `direct_NE[s, e]` is the node serving e for a token on node s when that
    # choice does not depend on the rest of the token's set (own node holds e, or a single node does);
    # -1 = several remote holders (decided per token below), -3 = no holder (an error); column E stands for
    # dropped ids (-> -2). One compiled pass over the pairs (`_assign_kernels.direct_nodes`).
    from . import _assign_kernels as _kernels

    holder_count_E = holds_NE.sum(axis=0)
    only_node_E = np.argmax(holds_NE, axis=0)
    single_E = np.where(holder_count_E == 1, only_node_E, np.where(holder_count_E == 0, -3, -1))
    direct_NE = np.where(holds_NE, np.arange(N)[:, None], single_E[None, :])
    direct_NE = np.concatenate([direct_NE, np.full((N, 1), -2, dtype=np.int64)], axis=1)  # column E: id -1
    src_node_T = src_T // G
    topk = np.ascontiguousarray(topk)
    pending_T, count_F, bad = _kernels.direct_counts(topk, src_node_T, direct_NE)
    if bad:
        raise _id_error(topk, slots)
    rows = np.flatnonzero(pending_T)
    node_PK = _kernels.pending_nodes(rows, topk, src_node_T, direct_NE)  # [P, K], the rows decided per token
    if rows.size:
        # Steps 3-4 compiled (`_assign_kernels.cover_rows`, spec: `_cover_replicated`); step 4b (rare) here.
        new_nodes_P, before_PK = _kernels.cover_rows(rows, topk, node_PK, holds_NE, src_node_T)
        if exact:
            for p in np.flatnonzero(new_nodes_P >= 3):
                _exact_row(int(rows[p]), before_PK[p], int(new_nodes_P[p]), topk, node_PK[p], holds_NE, N)
        _kernels.count_pending(rows, topk, node_PK, src_node_T, direct_NE, count_F)

    # Step 5: inside each node, pick the GPU; split replicated experts to even out GPU load.
    return _choose_ranks(topk, src_node_T, direct_NE, pending_T, node_PK, count_F, slot_of_WE, replicas_NE, G)


def _cover_replicated(
    rows: np.ndarray,
    topk: np.ndarray,
    node_TK: np.ndarray,
    pending_PK: np.ndarray,
    holds_NE: np.ndarray,
    src_node_T: np.ndarray,
    N: int,
    exact: bool,
) -> None:
    """Steps 3-4 for the tokens `rows` that still have experts held by several (remote) nodes
    (`pending_PK`: those pairs of the rows). The numpy specification of `_assign_kernels.cover_rows` (which
    `assign_tasks` runs); kept for the tests."""
    sub_e = np.where(pending_PK, topk[rows], 0)  # [P, K]
    pend = pending_PK.copy()
    sub_node = node_TK[rows].copy()
    # Nodes each token already visits (remote ones; its own node never holds a pending expert).
    visited_PN = np.zeros((rows.size, N), dtype=bool)
    placed = sub_node >= 0
    pr, pk = np.nonzero(placed)
    visited_PN[pr, sub_node[pr, pk]] = True
    visited_PN[np.arange(rows.size), src_node_T[rows]] = False
    cover_PKN = holds_NE.T[sub_e] & pend[..., None]  # [P, K, N]

    # Step 3: prefer nodes the token already visits.
    via_visited = cover_PKN & visited_PN[:, None, :]
    has = via_visited.any(axis=2)
    if has.any():
        pick = np.argmax(via_visited + _tie_break(rows.size, N, rows)[:, None, :], axis=2)
        sub_node = np.where(has, pick, sub_node)
        pend &= ~has
        cover_PKN &= ~has[..., None]

    # Step 4: greedy set cover with new nodes (each round takes the node covering most pending experts).
    tie_PN = _tie_break(rows.size, N, rows)
    new_nodes = np.zeros(rows.size, dtype=np.int64)
    before_greedy = pend.copy()
    while pend.any():
        active = np.nonzero(pend.any(axis=1))[0]
        gain = cover_PKN[active].sum(axis=1) + tie_PN[active]
        best = np.argmax(gain, axis=1)
        hit = cover_PKN[active, :, best] & pend[active]  # [A, K]
        ar, ak = np.nonzero(hit)
        sub_node[active[ar], ak] = best[ar]
        pend[active] &= ~hit
        cover_PKN[active] &= ~hit[..., None]
        new_nodes[active] += 1

    # Step 4b: greedy is optimal up to 2 new nodes; search exactly beyond that.
    if exact:
        for p in np.nonzero(new_nodes >= 3)[0]:
            _exact_row(int(rows[p]), before_greedy[p], int(new_nodes[p]), topk, sub_node[p], holds_NE, N)
    node_TK[rows] = sub_node


def _exact_row(t: int, pending_K: np.ndarray, greedy_nodes: int, topk: np.ndarray, node_K: np.ndarray,
               holds_NE: np.ndarray, N: int) -> None:
    """Step 4b for token t (`node_K`: its row of nodes, in place): replace the greedy cover of the
    `pending_K` pairs by a smaller one, if any."""
    ks = np.nonzero(pending_K)[0]
    masks = [sum(1 << i for i, k in enumerate(ks) if holds_NE[n, topk[t, k]]) for n in range(N)]
    found = _exact_cover(masks, (1 << ks.size) - 1, greedy_nodes)
    if found is None:
        return
    for i, k in enumerate(ks):
        node_K[k] = next(n for n in found if masks[n] >> i & 1)


def _choose_ranks(
    topk: np.ndarray, src_node_T: np.ndarray, direct_NE: np.ndarray, pending_T: np.ndarray, node_PK: np.ndarray,
    count_F: np.ndarray, slot_of_WE: np.ndarray, replicas_NE: np.ndarray, G: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Step 5: `(dest_rank_TK, dest_slot_TK)`; replicated (node, expert) groups water-filled over their GPUs.

    Single-copy pairs take the rank holding their expert on their node; the replicated groups (at most
    N * G * R of them) are taken largest first (LPT; ties: lower node * E + expert), each water-filled
    (`_water_fill`) over its replicas' ranks given the load placed so far; inside a group, pairs take the
    ranks in token order. One compiled output pass (`_assign_kernels.choose_ranks`), the node of each pair
    read from the `direct_NE` table or, for the pending rows, from `node_PK`; `count_F`: pairs per
    (node, expert), node * E + expert.
    """
    from . import _assign_kernels as _kernels

    W, E = slot_of_WE.shape
    N = W // G
    held_NGE = (slot_of_WE >= 0).reshape(N, G, E)
    rank_NE = np.arange(N)[:, None] * G + np.argmax(held_NGE, axis=1)  # first copy in the node
    return _kernels.choose_ranks(topk, src_node_T, direct_NE, pending_T, node_PK, count_F, slot_of_WE, rank_NE,
                                 np.ascontiguousarray(replicas_NE), G)


def _water_fill(load_R: np.ndarray, amount: int) -> np.ndarray:
    """`[R]` int64 non-negative shares summing to `amount` that minimise max(load + share)."""
    R = load_R.size
    order = np.argsort(load_R, kind="stable")
    sorted_load = load_R[order].astype(np.int64)
    # Find the level: the largest prefix j whose filling to sorted_load[j-1] costs at most `amount`.
    cost = np.arange(1, R + 1) * sorted_load - np.cumsum(sorted_load)
    j = int(np.searchsorted(cost, amount, side="right"))
    total = amount + int(sorted_load[:j].sum())
    level, extra = divmod(total, j)
    share_sorted = np.zeros(R, dtype=np.int64)
    share_sorted[:j] = level - sorted_load[:j]
    share_sorted[:extra] += 1
    share = np.zeros(R, dtype=np.int64)
    share[order] = share_sorted
    return share


def remote_nodes_per_token(dest_rank_TK: np.ndarray, source_rank_T: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """`[T]` int64 number of distinct remote nodes each token is dispatched to."""
    from . import _assign_kernels as _kernels

    dest = np.asarray(dest_rank_TK)
    if dest.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return _kernels.remote_nodes(np.ascontiguousarray(dest), np.asarray(source_rank_T, dtype=np.int64),
                                 int(gpus_per_node))
