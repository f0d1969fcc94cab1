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
