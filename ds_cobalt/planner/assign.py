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
5. inside the chosen node, splits the tokens of a replicated expert among its replicas so that GPU
   loads (number of (token, expert) pairs per rank, exact for this batch) are as even as possible.
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
    E = int(max(slots.max(initial=-1), topk.max(initial=-1))) + 1
    held = np.zeros(E, dtype=bool)
    held[slots[slots >= 0]] = True
    wanted = topk[topk >= 0]
    if wanted.size and not held[wanted].all():
        missing = np.unique(wanted[~held[wanted]])
        raise ValueError(f"assign_tasks: expert(s) {missing[:8].tolist()} are chosen but held by no slot")
    if topk.size and int(topk.min()) < -1:
        raise ValueError("assign_tasks: topk_ids_TK holds ids below -1")
    return topk.astype(np.int64), src.astype(np.int64), slots.astype(np.int64), E


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
    dest_rank_TK = np.full((T, K), -1, dtype=np.int64)
    dest_slot_TK = np.full((T, K), -1, dtype=np.int64)
    if T == 0:
        return dest_rank_TK, dest_slot_TK

    # Step 1: local experts: served on the token's own node.
    valid_TK = topk >= 0
    e_TK = np.where(valid_TK, topk, 0)
    src_node_T = src_T // G
    node_TK = np.where(valid_TK & holds_NE[src_node_T[:, None], e_TK], src_node_T[:, None], -1)

    # Step 2: experts held by a single node are forced there.
    holder_count_E = holds_NE.sum(axis=0)
    only_node_E = np.argmax(holds_NE, axis=0)
    forced_TK = valid_TK & (node_TK < 0) & (holder_count_E[e_TK] == 1)
    node_TK = np.where(forced_TK, only_node_E[e_TK], node_TK)

    pending_TK = valid_TK & (node_TK < 0)
    if pending_TK.any():
        rows = np.nonzero(pending_TK.any(axis=1))[0]
        _cover_replicated(rows, topk, node_TK, pending_TK, holds_NE, src_node_T, N, exact)

    # Step 5: inside each node, pick the GPU; split replicated experts to even out GPU load.
    _choose_ranks(topk, node_TK, valid_TK, slot_of_WE, replicas_NE, G, dest_rank_TK, dest_slot_TK)
    return dest_rank_TK, dest_slot_TK


def _cover_replicated(
    rows: np.ndarray,
    topk: np.ndarray,
    node_TK: np.ndarray,
    pending_TK: np.ndarray,
    holds_NE: np.ndarray,
    src_node_T: np.ndarray,
    N: int,
    exact: bool,
) -> None:
    """Steps 3-4 for the tokens `rows` that still have experts held by several (remote) nodes."""
    sub_e = np.where(pending_TK[rows], topk[rows], 0)  # [P, K]
    pend = pending_TK[rows].copy()
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
            ks = np.nonzero(before_greedy[p])[0]
            masks = [sum(1 << i for i, k in enumerate(ks) if holds_NE[n, topk[rows[p], k]]) for n in range(N)]
            found = _exact_cover(masks, (1 << ks.size) - 1, int(new_nodes[p]))
            if found is None:
                continue
            for i, k in enumerate(ks):
                sub_node[p, k] = next(n for n in found if masks[n] >> i & 1)
    node_TK[rows] = sub_node


def _choose_ranks(
    topk: np.ndarray,
    node_TK: np.ndarray,
    valid_TK: np.ndarray,
    slot_of_WE: np.ndarray,
    replicas_NE: np.ndarray,
    G: int,
    dest_rank_TK: np.ndarray,
    dest_slot_TK: np.ndarray,
) -> None:
    """Step 5: rank and slot per pair; water-fill replicated (node, expert) groups over their GPUs."""
    W, E = slot_of_WE.shape
    t_idx, k_idx = np.nonzero(valid_TK)
    e_P = topk[t_idx, k_idx]
    n_P = node_TK[t_idx, k_idx]
    # Single-copy pairs: the one rank in the node holding e.
    held_NGE = (slot_of_WE >= 0).reshape(-1, G, E)
    first_local_NE = np.argmax(held_NGE, axis=1)  # [N, E] local rank of the first copy
    rank_P = n_P * G + first_local_NE[n_P, e_P]
    multi_P = replicas_NE[n_P, e_P] > 1
    load_W = np.bincount(rank_P[~multi_P], minlength=W).astype(np.int64)
    if multi_P.any():
        mi = np.nonzero(multi_P)[0]
        group = n_P[mi] * E + e_P[mi]
        order = np.argsort(group, kind="stable")
        mi, group = mi[order], group[order]
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        ends = np.r_[starts[1:], group.size]
        # Largest groups first (LPT), each water-filled over its replicas' ranks.
        for g in np.argsort(-(ends - starts), kind="stable"):
            members = mi[starts[g] : ends[g]]
            n, e = divmod(int(group[starts[g]]), E)
            ranks = n * G + np.nonzero(held_NGE[n, :, e])[0]
            share = _water_fill(load_W[ranks], members.size)
            rank_P[members] = np.repeat(ranks, share)
            load_W[ranks] += share
    dest_rank_TK[t_idx, k_idx] = rank_P
    dest_slot_TK[t_idx, k_idx] = slot_of_WE[rank_P, e_P]


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
    T, K = dest_rank_TK.shape
    if T == 0:
        return np.zeros(0, dtype=np.int64)
    node_TK = np.where(dest_rank_TK >= 0, dest_rank_TK // gpus_per_node, -1)
    remote = (node_TK >= 0) & (node_TK != (source_rank_T // gpus_per_node)[:, None])
    node_TK = np.sort(np.where(remote, node_TK, -1), axis=1)
    first = np.ones((T, K), dtype=bool)
    first[:, 1:] = node_TK[:, 1:] != node_TK[:, :-1]
    return ((node_TK >= 0) & first).sum(axis=1)
