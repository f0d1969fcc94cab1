"""EPLB-style hierarchical load balancer (DeepSeek), reimplemented from its published description.

Legend: E experts, Q expert groups, N nodes, G GPUs per node, W = N * G ranks, R spare slots per rank.

Step 1: pack expert groups (Q contiguous groups of E / Q experts) onto nodes, heaviest group first onto
        the lightest node with room, Q / N groups per node.
Step 2: inside each node, give the G * R redundant copies one at a time to the expert with the largest
        load per copy.
Step 3: pack the node's physical experts onto its GPUs (balanced, equal slot counts).
Load only: co-activation is ignored.
"""

from __future__ import annotations

import numpy as np

from .stage2 import pack_node, replicate_hot

__all__ = ["balanced_packing", "eplb_layer"]


def balanced_packing(weight_I: np.ndarray, packs: int) -> np.ndarray:
    """`[I]` pack index per item: heaviest first onto the lightest pack that still has room (I / packs)."""
    items = weight_I.size
    per = items // packs
    pack_of_I = np.empty(items, dtype=np.int64)
    load_P = np.zeros(packs)
    count_P = np.zeros(packs, dtype=np.int64)
    for i in np.argsort(-weight_I, kind="stable"):
        p = int(np.argmin(np.where(count_P < per, load_P, np.inf)))
        pack_of_I[i] = p
        load_P[p] += weight_I[i]
        count_P[p] += 1
    return pack_of_I


def eplb_layer(load_E: np.ndarray, nodes: int, gpus_per_node: int, redundant_slots: int,
               num_groups: int | None = None) -> np.ndarray:
    """`[W, S]` slots of one layer (owner convention: owners first)."""
    E, N, G, R = load_E.size, nodes, gpus_per_node, redundant_slots
    Q = num_groups if num_groups is not None else N * G
    if E % Q or Q % N:
        Q = N  # fall back to one group per node slot share
    # Step 1: groups to nodes.
    group_load_Q = load_E.reshape(Q, E // Q).sum(axis=1)
    node_of_Q = balanced_packing(group_load_Q, N)
    node_of_E = np.repeat(node_of_Q, E // Q)
    per_gpu = E // (N * G)
    slots_WS = np.full((N * G, per_gpu + R), -1, dtype=np.int64)
    for n in range(N):
        ids = np.nonzero(node_of_E == n)[0]
        # Step 2: redundant copies to the experts with most load per copy (at most one copy per GPU).
        copies = np.minimum(replicate_hot(load_E[ids].astype(np.float64), G * R), G)
        per_copy = load_E[ids] / copies
        # Step 3: pack owners and replicas onto the node's GPUs.
        slots_WS[n * G : (n + 1) * G] = pack_node(
            per_copy, ids, np.repeat(per_copy, copies - 1), np.repeat(ids, copies - 1), G, R
        )
    return slots_WS
