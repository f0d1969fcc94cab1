"""Stage 2, intra-node placement: replicas for hot experts and packing slots onto a node's GPUs.

Legend: E experts, N nodes, G GPUs per node, W = N * G ranks, S slots per rank (O owner + R spare),
C copies (physical slots) on one node.

Entry points:
- `node_loads(...)`: `[N, E]` expected (token, expert) pairs each node serves for a given node coverage,
  computed with the same rule as `assign_tasks` on sample tokens.
- `pack_node(...)`: one node's owners and spare-slot experts onto its G GPUs, LPT + swap polish.
- `plan_gpus(...)`: every node, with spare slots left after cross-node replicas filled by replicas of
  the node's hottest experts (EPLB's "most load per copy" rule), returning `[W, S]` slots.
"""

from __future__ import annotations

import numpy as np

from .assign import assign_tasks

__all__ = ["node_loads", "replicate_hot", "pack_node", "plan_gpus"]


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
    no copy of the same expert), then pairwise swaps of same-kind items that lower the heavier GPU.
    """
    G = gpus
    per_gpu = owner_ids_O.size // G
    R = spare_per_gpu
    gpu_of_owner = np.full(owner_ids_O.size, -1, dtype=np.int64)
    gpu_of_spare = np.full(spare_ids_X.size, -1, dtype=np.int64)
    load_G = np.zeros(G)
    used_owner_G = np.zeros(G, dtype=np.int64)
    used_spare_G = np.zeros(G, dtype=np.int64)
    held: list[set[int]] = [set() for _ in range(G)]
    # Step 1: one list, heaviest first; owners and spare items fill their own slot kinds.
    items = [(float(owner_load_O[i]), 0, i) for i in range(owner_ids_O.size)]
    items += [(float(spare_load_X[i]), 1, i) for i in range(spare_ids_X.size)]
    items.sort(key=lambda x: (-x[0], x[1], x[2]))
    for load, kind, i in items:
        e = int(owner_ids_O[i] if kind == 0 else spare_ids_X[i])
        free = used_owner_G < per_gpu if kind == 0 else used_spare_G < R
        ok = free & np.array([e not in h for h in held])
        if not ok.any():
            if kind == 1:
                continue  # no GPU can take another copy: leave the spare slot empty
            ok = free
        g = int(np.argmin(np.where(ok, load_G, np.inf)))
        load_G[g] += load
        held[g].add(e)
        if kind == 0:
            gpu_of_owner[i] = g
            used_owner_G[g] += 1
        else:
            gpu_of_spare[i] = g
            used_spare_G[g] += 1
    # Step 2: swap polish between the heaviest GPU and the others.
    for _ in range(4 * G):
        hi = int(np.argmax(load_G))
        best = (0.0, -1, -1, -1)
        for kind, gpu_of, loads, ids in ((0, gpu_of_owner, owner_load_O, owner_ids_O),
                                         (1, gpu_of_spare, spare_load_X, spare_ids_X)):
            on_hi = np.nonzero(gpu_of == hi)[0]
            for lo in np.argsort(load_G)[: min(G - 1, 3)]:
                if lo == hi or on_hi.size == 0:
                    continue
                on_lo = np.nonzero(gpu_of == lo)[0]
                if on_lo.size == 0:
                    continue
                d_AB = loads[on_hi][:, None] - loads[on_lo][None, :]
                gain_AB = load_G[hi] - np.maximum(load_G[hi] - d_AB, load_G[lo] + d_AB)
                bad_A = np.isin(ids[on_hi], list(held[lo]))
                bad_B = np.isin(ids[on_lo], list(held[hi]))
                gain_AB[(d_AB <= 0) | bad_A[:, None] | bad_B[None, :]] = 0.0
                ia, ib = np.unravel_index(int(np.argmax(gain_AB)), gain_AB.shape)
                if gain_AB[ia, ib] > best[0] + 1e-12:
                    best = (float(gain_AB[ia, ib]), kind, int(on_hi[ia]), int(on_lo[ib]))
        if best[1] < 0:
            break
        _, kind, a, b = best
        gpu_of, ids, loads = ((gpu_of_owner, owner_ids_O, owner_load_O) if kind == 0
                              else (gpu_of_spare, spare_ids_X, spare_load_X))
        lo = int(gpu_of[b])
        d = loads[a] - loads[b]
        held[hi].discard(int(ids[a]))
        held[lo].discard(int(ids[b]))
        held[hi].add(int(ids[b]))
        held[lo].add(int(ids[a]))
        gpu_of[a], gpu_of[b] = lo, hi
        load_G[hi] -= d
        load_G[lo] += d
    out = np.full((G, per_gpu + R), -1, dtype=np.int64)
    for g in range(G):
        own = np.sort(owner_ids_O[gpu_of_owner == g])
        spare = spare_ids_X[gpu_of_spare == g]
        # A spare copy that collides with an owner forced onto the same GPU is dropped.
        spare = np.array([e for i, e in enumerate(spare) if e not in own and e not in spare[:i]], dtype=np.int64)
        out[g, :per_gpu] = own
        out[g, per_gpu : per_gpu + spare.size] = spare
    return out


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
        ids = np.concatenate([owners, extras])
        load = load_NE[n, ids]
        spare_left = G * R - extras.size
        # Step 1: replicas of the node's hottest experts in the free spare slots (at most G copies each).
        copies = replicate_hot(load, spare_left) if (fill_hot and spare_left) else np.ones(ids.size, np.int64)
        copies = np.minimum(copies, G)
        per_copy = load / copies
        is_owner = np.arange(ids.size) < owners.size
        # Step 2: owners keep one copy in owner slots; every other copy goes to a spare slot.
        spare_ids = np.concatenate([np.repeat(ids, copies - 1) if ids.size else ids, ids[~is_owner]])
        spare_load = np.concatenate([np.repeat(per_copy, copies - 1), per_copy[~is_owner]])
        slots_WS[n * G : (n + 1) * G] = pack_node(per_copy[is_owner], ids[is_owner], spare_load, spare_ids, G, R)
    return slots_WS
