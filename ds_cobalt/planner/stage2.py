"""Stage 2, intra-node placement: replicas for hot experts and packing slots onto a node's GPUs.

Legend: E experts, N nodes, G GPUs per node, W = N * G ranks, S slots per rank (O owner + R spare),
C copies (physical slots) on one node.

Entry points:
- `node_loads(...)`: `[N, E]` expected (token, expert) pairs each node serves for a given node coverage,
  computed with the same rule as `assign_tasks` on sample tokens.
- `pack_node(...)`: one node's owners and spare-slot experts onto its G GPUs, LPT + swap polish.
- `plan_gpus(...)`: every node, with spare slots left after cross-node replicas filled by replicas of
  the node's hottest experts (EPLB's "most load per copy" rule), returning `[W, S]` slots.
- `refill_node(...)`: stage 2 per step, one node's free spare slots refilled from one step's loads (the rule the
  runtime applies every forward, `runtime/step_spares.py`, and the replay simulates, `sim/replay.py`).
"""

from __future__ import annotations

import numpy as np

from .assign import assign_tasks
from .layout import cross_node_copies, owner_rank_of

__all__ = ["node_loads", "replicate_hot", "pack_node", "plan_gpus", "refillable_slots", "refill_node", "refill_layout",
           "max_over_mean"]


def node_loads(
    topk_ids_TK: np.ndarray, source_node_T: np.ndarray, holds_NE: np.ndarray
) -> np.ndarray:
    """`[N, E]` float64 (token, expert) pairs served by each node when node n holds `holds_NE[n]`."""
    N, E = holds_NE.shape
    width = int(holds_NE.sum(axis=1).max())
    slots_NS = np.full((N, width), -1, dtype=np.int64)
    for n in range(N):
        held = np.nonzero(holds_NE[n])[0]
        slots_NS[n, : held.size] = held
    # One "rank" per node: assign_tasks then only chooses nodes.
    dest_TK, _ = assign_tasks(topk_ids_TK, source_node_T, slots_NS, 1)
    valid = dest_TK >= 0
    flat = dest_TK[valid] * E + topk_ids_TK[valid]
    return np.bincount(flat, minlength=N * E).reshape(N, E).astype(np.float64)


def replicate_hot(load_C: np.ndarray, spare: int) -> np.ndarray:
    """`[C]` int64 copy count per item after giving `spare` extra copies, each to the item with the
    largest load per copy (EPLB's replicate rule). Items with zero load get none."""
    copies = np.ones(load_C.size, dtype=np.int64)
    for _ in range(spare):
        per_copy = load_C / copies
        i = int(np.argmax(per_copy))
        if per_copy[i] <= 0:
            break
        copies[i] += 1
    return copies


def pack_node(
    owner_load_O: np.ndarray,
    owner_ids_O: np.ndarray,
    spare_load_X: np.ndarray,
    spare_ids_X: np.ndarray,
    gpus: int,
    spare_per_gpu: int,
) -> np.ndarray:
    """`[G, O/G + R]` expert ids: owners in the first O/G slots, spare-slot items after (-1 = unused).

    Loads are per copy. LPT (heaviest first onto the lightest GPU with a free slot of the right kind and
    no copy of the same expert), then pairwise swaps of same-kind items between the heaviest GPU and the 3
    lightest others that lower the heavier GPU. Ties go to the lower index (GPU, item).
    """
    from . import _stage2_kernels as _kernels

    G = gpus
    R = spare_per_gpu
    owner_ids_O = np.asarray(owner_ids_O, dtype=np.int64)
    spare_ids_X = np.asarray(spare_ids_X, dtype=np.int64)
    # Step 1 order: one list, heaviest first (ties: owners first, then by index); owners and spare items
    # fill their own slot kinds. Steps 1-2 run compiled (`_stage2_kernels.pack_items`).
    load_I = np.concatenate([np.asarray(owner_load_O, np.float64), np.asarray(spare_load_X, np.float64)])
    kind_I = np.repeat(np.array([0, 1], dtype=np.int64), [owner_ids_O.size, spare_ids_X.size])
    idx_I = np.concatenate([np.arange(owner_ids_O.size), np.arange(spare_ids_X.size)]).astype(np.int64)
    order = np.lexsort((idx_I, kind_I, -load_I))
    ids_I = np.concatenate([owner_ids_O, spare_ids_X])
    num_ids = int(ids_I.max(initial=-1)) + 1
    return _kernels.pack_items(load_I[order], kind_I[order], idx_I[order], ids_I[order], owner_ids_O.size,
                               spare_ids_X.size, G, R, num_ids)


def plan_gpus(
    node_of_E: np.ndarray,
    extra_NE: np.ndarray,
    load_NE: np.ndarray,
    gpus_per_node: int,
    redundant_slots: int,
    *,
    fill_hot: bool = True,
) -> np.ndarray:
    """`[W, S]` slots of one layer from stage 1's owners and cross-node replicas.

    Args:
        node_of_E: `[E]` owner node per expert (E / N per node).
        extra_NE: `[N, E]` bool, cross-node replicas chosen for node n (at most G * R per node).
        load_NE: `[N, E]` expected pairs node n serves for expert e (e.g. from `node_loads`).
        fill_hot: fill remaining spare slots with replicas of the node's hottest experts.
    """
    E = node_of_E.size
    N = extra_NE.shape[0]
    G, R = gpus_per_node, redundant_slots
    per_gpu = E // (N * G)
    slots_WS = np.full((N * G, per_gpu + R), -1, dtype=np.int64)
    for n in range(N):
        owners = np.nonzero(node_of_E == n)[0]
        extras = np.nonzero(extra_NE[n] & (node_of_E != n))[0]
        if extras.size > G * R:
            raise ValueError(f"node {n} has {extras.size} replicas but only {G * R} spare slots")
        ids, per_copy, spare_ids, spare_load = _node_copies(owners, extras, load_NE[n], G, R, fill_hot)
        is_owner = np.arange(ids.size) < owners.size
        slots_WS[n * G : (n + 1) * G] = pack_node(per_copy[is_owner], ids[is_owner], spare_load, spare_ids, G, R)
    return slots_WS


def _node_copies(owners: np.ndarray, extras: np.ndarray, load_E: np.ndarray, G: int, R: int, fill_hot: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One node's items (`ids`: owners, then cross-node replicas), their load per copy, and what goes into spare
    slots (ids and loads per copy): the replicas, plus (`fill_hot`) extra copies of the node's hottest experts
    in the spare slots left (at most G copies each); owners keep one copy in their owner slots."""
    ids = np.concatenate([owners, extras])
    load = load_E[ids]
    left = G * R - extras.size
    copies = replicate_hot(load, left) if (fill_hot and left) else np.ones(ids.size, np.int64)
    copies = np.minimum(copies, G)
    per_copy = load / copies
    is_owner = np.arange(ids.size) < owners.size
    spare_ids = np.concatenate([np.repeat(ids, copies - 1) if ids.size else ids, ids[~is_owner]])
    spare_load = np.concatenate([np.repeat(per_copy, copies - 1), per_copy[~is_owner]])
    return ids, per_copy, spare_ids, spare_load


def max_over_mean(load: np.ndarray) -> float:
    """Largest over mean load (1.0 when there is no load): the balance figure of GPUs or nodes."""
    mean = float(np.mean(load)) if np.size(load) else 0.0
    return float(np.max(load)) / mean if mean > 0 else 1.0


def refillable_slots(slots_WS: np.ndarray, gpus_per_node: int, num_experts: int) -> np.ndarray:
    """`[W, S]` bool: spare slots stage 2 refills every step: empty ones and those holding an expert owned on
    the same node. A spare slot holding an expert owned on another node is a traffic copy (stage 1's)."""
    free_WS = ~cross_node_copies(slots_WS, num_experts, gpus_per_node)
    free_WS[:, : num_experts // slots_WS.shape[0]] = False
    return free_WS


def refill_layout(slots_WS: np.ndarray, load_NE: np.ndarray, gpus_per_node: int,
                  num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """`refill_node` on every node (`load_NE[n]`: routes per expert reaching node n), with the experts owned on
    the node eligible: the whole `[W, S]` refilled layout and the rows each slot serves."""
    G, W = gpus_per_node, slots_WS.shape[0]
    free_WS = refillable_slots(slots_WS, G, num_experts)
    owner_node_E = owner_rank_of(slots_WS, num_experts) // G
    out, share = np.empty_like(slots_WS), np.empty_like(slots_WS)
    for n in range(W // G):
        rows = slice(n * G, (n + 1) * G)
        out[rows], share[rows] = refill_node(slots_WS[rows], free_WS[rows], load_NE[n], owner_node_E == n)
    return out, share


_OUTSIDE = 1 << 40  # stands for "not a copy of this expert" in the integer water-fill (no overflow below 2**62)


def _water_fill(base_XG: np.ndarray, member_XG: np.ndarray, load_X: np.ndarray) -> np.ndarray:
    """`[X, G]` integer shares: each row's `load_X` rows poured onto its member GPUs, lowest base load first,
    so the largest `base + share` is as low as it can be; the remainder rows go to the lower (base, GPU)."""
    X, G = base_XG.shape
    b_XG = np.where(member_XG, base_XG, _OUTSIDE)
    order_XG = np.argsort(b_XG, axis=1, kind="stable")
    bs_XG = np.take_along_axis(b_XG, order_XG, 1)
    prefix_XG = np.cumsum(bs_XG, 1)
    k_G = np.arange(1, G + 1)
    active_X = ((k_G * bs_XG - prefix_XG) <= load_X[:, None]).sum(1)  # GPUs that end at the common level
    active_X = np.maximum(active_X, 1)
    total_X = load_X + np.take_along_axis(prefix_XG, (active_X - 1)[:, None], 1)[:, 0]
    level_X, rem_X = total_X // active_X, total_X % active_X
    j_G = np.arange(G)[None, :]
    share_sorted = np.where(j_G < active_X[:, None], level_X[:, None] + (j_G < rem_X[:, None]) - bs_XG, 0)
    share_XG = np.zeros_like(share_sorted)
    np.put_along_axis(share_XG, order_XG, share_sorted, 1)
    return np.where(member_XG, share_XG, 0)


def refill_node(block_GS: np.ndarray, free_GS: np.ndarray, load_E: np.ndarray,
                eligible_E: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stage 2 for one step on one node: `[G, S]` slots with the slots in `free_GS` refilled, and `[G, S]` the
    rows each slot serves, from the node's integer `load_E` (routes per expert).

    An expert's rows are split over its copies so that the most loaded of them is as low as it can be (integer
    water-filling, `_water_fill`). Each free slot in turn takes the copy (an expert held on the node and in
    `eligible_E`, default all, on a GPU with a free slot and no copy of it) that leaves the lowest largest GPU
    load, then the lowest sum of squared GPU loads; it stays empty when no copy lowers either. Integer arithmetic
    only and ties to the lower index (expert, GPU, slot): every rank of the node decides the same."""
    G, S = block_GS.shape
    free = np.asarray(free_GS, dtype=bool).copy()
    out = np.where(free, -1, block_GS).astype(np.int64)
    load_E = np.asarray(load_E, dtype=np.int64)
    ids = np.unique(out[out >= 0])
    held_GI = (out[:, :, None] == ids[None, None, :]).any(1)
    load_I = load_E[ids]
    share_IG = (held_GI * load_I).T  # one copy: all its rows
    multi_I = held_GI.sum(0) > 1
    share_IG[multi_I] = 0
    for i in [i for i in np.lexsort((np.arange(ids.size), -load_I)) if multi_I[i]]:  # heaviest first
        share_IG[i] = _water_fill((share_IG.sum(0) - share_IG[i])[None], held_GI[:, i][None], load_I[i:i + 1])[0]
    can_I = load_I > 0
    if eligible_E is not None:
        can_I &= np.asarray(eligible_E, dtype=bool)[ids]
    while free.any() and ids.size:
        load_G = share_IG.sum(0)
        cand_i, cand_g = np.nonzero(can_I[:, None] & ~held_GI.T & free.any(1)[None, :])
        if cand_i.size == 0:
            break
        member_XG = held_GI.T[cand_i].copy()
        member_XG[np.arange(cand_i.size), cand_g] = True
        base_XG = load_G[None, :] - share_IG[cand_i]
        new_XG = base_XG + _water_fill(base_XG, member_XG, load_I[cand_i])
        new_max, new_ss = new_XG.max(1), (new_XG ** 2).sum(1)
        best = int(np.lexsort((cand_g, cand_i, new_ss, new_max))[0])
        if (new_max[best], new_ss[best]) >= (load_G.max(), (load_G ** 2).sum()):
            break
        i, g = int(cand_i[best]), int(cand_g[best])
        slot = int(np.argmax(free[g]))
        out[g, slot], free[g, slot], held_GI[g, i] = ids[i], False, True
        share_IG[i] = new_XG[best] - base_XG[best]
    # an expert's share on a GPU goes to its first slot there
    first_GS = (out >= 0) & ~np.tril(out[:, :, None] == out[:, None, :], -1).any(2)
    index_GS = np.searchsorted(ids, np.maximum(out, 0)).clip(max=max(ids.size - 1, 0))
    share_GS = np.where(first_GS, share_IG[index_GS, np.arange(G)[:, None]] if ids.size else 0, 0)
    return out, share_GS


def fill_spares(owner_WP: np.ndarray, load_NE: np.ndarray, extra_NE: np.ndarray, gpus_per_node: int,
                redundant_slots: int, *, fill_hot: bool = True) -> np.ndarray:
    """`[W, P + R]` slots with the owners of `owner_WP` kept where they are (no owner moves) and the spare
    slots filled: each node's cross-node replicas `extra_NE`, then (`fill_hot`) copies of its hottest experts.
    Loads are per copy (`load_NE` split over a node's copies); LPT onto the lightest GPU of the node with a
    free spare slot and no copy of the expert (ties: lower GPU, lower expert)."""
    owner_WP = np.asarray(owner_WP, dtype=np.int64)
    W, P = owner_WP.shape
    G, R = gpus_per_node, redundant_slots
    N = W // G
    slots_WS = np.full((W, P + R), -1, dtype=np.int64)
    slots_WS[:, :P] = owner_WP
    for n in range(N):
        rows = slice(n * G, (n + 1) * G)
        owners = owner_WP[rows].reshape(-1)
        owners = owners[owners >= 0]
        extras = np.nonzero(extra_NE[n])[0]
        extras = extras[~np.isin(extras, owners)][: G * R]
        ids, per_copy, spare_ids, spare_load = _node_copies(owners, extras, load_NE[n], G, R, fill_hot)
        gpu_load = np.array([per_copy[np.isin(ids, owner_WP[n * G + g])].sum() for g in range(G)])
        free = np.full(G, R)
        for i in np.lexsort((spare_ids, -spare_load)):
            e = spare_ids[i]
            held = (slots_WS[rows] == e).any(axis=1)
            ok = np.nonzero((free > 0) & ~held)[0]
            if ok.size == 0:
                continue
            g = int(ok[np.argmin(gpu_load[ok])])
            slots_WS[n * G + g, P + R - free[g]] = e
            free[g] -= 1
            gpu_load[g] += spare_load[i]
        # slots no planned copy could take (every candidate already on that GPU): the hottest expert it lacks
        hot_first = ids[np.lexsort((ids, -load_NE[n, ids]))]
        for g in np.nonzero(free > 0)[0]:
            row = slots_WS[n * G + g]
            for e in hot_first[~np.isin(hot_first, row)][: free[g]]:
                row[P + R - free[g]] = e
                free[g] -= 1
    return slots_WS
