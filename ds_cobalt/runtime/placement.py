"""Device-side lookup tables for one layer's layout, and the communication-aware task assignment.

Legend: T tokens, K routes per token, E experts, N nodes, G ranks per node, W = N * G ranks,
S slots per rank, M = most replicas of one expert on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planner.layout import owner_rank_of


@dataclass(frozen=True)
class LayerPlacement:
    """One layer's layout (`slots_WS[r, s]` = logical expert in slot s of EP rank r) as device tables."""

    slots_WS: np.ndarray  # [W, S] int64 on host, -1 = empty
    ranks_per_node: int
    num_experts: int
    holds_EN: torch.Tensor  # [E, N] bool: node n holds a copy of expert e
    replica_count_EN: torch.Tensor  # [E, N] int64: copies of expert e on node n
    replica_rank_ENM: torch.Tensor  # [E, N, M] int64 EP rank of the m-th copy on node n, -1 = none
    replica_slot_ENM: torch.Tensor  # [E, N, M] int64 slot of that copy, -1 = none
    owner_block_E: torch.Tensor  # [E] int64 owner rank * (E / W) + owner slot (the dense schedule's block)
    single_copy: bool = False  # every expert has exactly one copy (no replicas): its owner serves every route

    @property
    def world_size(self) -> int:
        return int(self.slots_WS.shape[0])

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def slots_per_rank(self) -> int:
        return int(self.slots_WS.shape[1])

    @property
    def owner_slots_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def owner_rank_E(self) -> np.ndarray:
        """`[E]` EP rank owning each expert (first E/W slots of each rank are owner slots)."""
        return owner_rank_of(self.slots_WS, self.num_experts)


def build_placement(slots_WS: np.ndarray, ranks_per_node: int, num_experts: int,
                    device: torch.device | str = "cpu") -> LayerPlacement:
    slots_WS = np.asarray(slots_WS, dtype=np.int64)
    W, S = slots_WS.shape
    N = W // ranks_per_node
    per_rank = num_experts // W
    owners = slots_WS[:, :per_rank].reshape(-1)
    if sorted(owners.tolist()) != list(range(num_experts)):
        raise ValueError("layout: the first num_experts/world_size slots of the ranks must hold every expert "
                         "exactly once (owner slots); use ds_cobalt.planner.canonical_owner_order")
    count_EN = np.zeros((num_experts, N), dtype=np.int64)
    entries: list[tuple[int, int, int, int]] = []  # (expert, node, rank, slot)
    for r in range(W):
        for s in range(S):
            e = int(slots_WS[r, s])
            if e >= 0:
                entries.append((e, r // ranks_per_node, r, s))
                count_EN[e, r // ranks_per_node] += 1
    M = max(1, int(count_EN.max()))
    rank_ENM = np.full((num_experts, N, M), -1, dtype=np.int64)
    slot_ENM = np.full((num_experts, N, M), -1, dtype=np.int64)
    fill = np.zeros((num_experts, N), dtype=np.int64)
    for e, n, r, s in entries:
        rank_ENM[e, n, fill[e, n]] = r
        slot_ENM[e, n, fill[e, n]] = s
        fill[e, n] += 1
    block_E = np.empty(num_experts, dtype=np.int64)
    block_E[slots_WS[:, :per_rank].reshape(-1)] = np.arange(W * per_rank)
    as_tensor = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    return LayerPlacement(slots_WS, ranks_per_node, num_experts, as_tensor(count_EN > 0), as_tensor(count_EN),
                          as_tensor(rank_ENM), as_tensor(slot_ENM), as_tensor(block_E),
                          single_copy=bool((count_EN.sum(1) == 1).all()))


def rank_within_key(key: torch.Tensor) -> torch.Tensor:
    """For each entry of the 1-D `key`, how many earlier entries (in index order) share its key."""
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    index = torch.arange(key.numel(), device=key.device)
    start = torch.cummax(torch.where(first, index, 0), 0).values
    rank = torch.empty_like(key)
    rank[order] = index - start
    return rank


def assign_nodes(topk_ids_TK: torch.Tensor, placement: LayerPlacement, src_rank: int) -> torch.Tensor:
    """Steps 1-3 of `assign_tasks`: the node serving every (token, route) of tokens living on `src_rank`
    (int64 `[T, K]`, -1 where `topk_ids_TK` is -1)."""
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    N, G = placement.nodes, placement.ranks_per_node
    src_node = src_rank // G
    valid_TK = topk_ids_TK >= 0
    ids_TK = topk_ids_TK.clamp(min=0).long()
    if placement.single_copy:  # the one copy (the owner) serves every route
        block_TK = placement.owner_block_E[ids_TK]
        node_TK = block_TK // (placement.owner_slots_per_rank * G)
        return torch.where(valid_TK, node_TK, torch.full_like(node_TK, -1))
    holds_TKN = placement.holds_EN[ids_TK] & valid_TK.unsqueeze(-1)
    node_TK = torch.full((T, K), -1, dtype=torch.long, device=device)
    # Rotated tie-break priority: the node after the source node wins ties first.
    priority_N = (torch.arange(N, device=device) - src_node - 1) % N
    tie_N = (N - priority_N).to(torch.long)

    # Step 1: own node.
    node_TK = torch.where(holds_TKN[:, :, src_node], src_node, node_TK)  # no boolean-mask write (host sync)
    visited_TN = torch.zeros((T, N), dtype=torch.bool, device=device)
    visited_TN[:, src_node] = True
    for _ in range(K + 1):  # each pass opens at most one node per token; K opens always suffice
        # Step 2: nodes the token already visits.
        remaining_TK = valid_TK & (node_TK < 0)
        # on the CPU the passes stop once every route has its node (a later pass changes nothing; reading a CPU
        # tensor waits for nothing: ~2 of 7 passes for top-6 on 2 nodes); on a GPU all run, without a host sync
        if device.type == "cpu" and not remaining_TK.numpy().any():
            break
        reuse_TKN = holds_TKN & visited_TN.unsqueeze(1) & remaining_TK.unsqueeze(-1)
        reuse_score_TKN = reuse_TKN.long() * tie_N
        has_reuse_TK = reuse_TKN.any(-1)
        node_TK = torch.where(has_reuse_TK, reuse_score_TKN.argmax(-1), node_TK)
        remaining_TK = valid_TK & (node_TK < 0)
        # Step 3: open the node covering most remaining routes of the token.
        cover_TN = (holds_TKN & remaining_TK.unsqueeze(-1)).sum(1)
        best_T = (cover_TN * (N + 1) + tie_N).argmax(-1)
        opens_T = cover_TN.gather(1, best_T[:, None]).squeeze(1) > 0
        visited_TN |= torch.nn.functional.one_hot(best_T, N).bool() & opens_T.unsqueeze(1)
    return node_TK


def remote_nodes_per_token(topk_ids_TK: torch.Tensor, placement: LayerPlacement, src_rank: int) -> torch.Tensor:
    """`[T]` int64: the distinct remote nodes each token living on `src_rank` is sent to (`assign_nodes`)."""
    node_TK = assign_nodes(topk_ids_TK, placement, src_rank)
    remote_TK = (node_TK >= 0) & (node_TK != src_rank // placement.ranks_per_node)
    hit_TN = torch.zeros((node_TK.shape[0], placement.nodes), dtype=torch.long, device=node_TK.device)
    hit_TN.scatter_add_(1, node_TK.clamp(min=0), remote_TK.long())
    return (hit_TN > 0).sum(1)


def assign_tasks(topk_ids_TK: torch.Tensor, placement: LayerPlacement,
                 src_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick a physical copy (EP rank, slot) for every (token, route) of tokens living on `src_rank`.

    Nodes first (`assign_nodes`): a route goes to the token's own node when it holds the expert, else to a node
    the token already visits, else to the node covering most of the token's remaining routes (greedy set
    cover, ties rotated from the source node so sources spread). Inside the chosen node, routes of one
    expert are dealt round-robin over its copies (offset by the source rank) to balance GPUs.
    Returns `dest_rank_TK`, `dest_slot_TK` (int64, -1 where `topk_ids_TK` is -1).
    """
    T, K = topk_ids_TK.shape
    N = placement.nodes
    valid_TK = topk_ids_TK >= 0
    ids_TK = topk_ids_TK.clamp(min=0).long()
    if placement.single_copy:  # no choice to make: the one copy (the owner) serves every route
        per_rank = placement.owner_slots_per_rank
        block_TK = placement.owner_block_E[ids_TK]
        minus = torch.full_like(block_TK, -1)
        return (torch.where(valid_TK, block_TK // per_rank, minus), torch.where(valid_TK, block_TK % per_rank, minus))
    node_TK = assign_nodes(topk_ids_TK, placement, src_rank)

    # Step 4: pick the copy inside the chosen node, round-robin per (expert, node).
    flat_ids = ids_TK.reshape(-1)
    flat_node = node_TK.reshape(-1).clamp(min=0)
    key = flat_ids * N + flat_node
    key = torch.where(valid_TK.reshape(-1), key, torch.full_like(key, -1))
    rank_in_key = rank_within_key(key)
    copies = placement.replica_count_EN[flat_ids, flat_node].clamp(min=1)
    pick = (rank_in_key + src_rank) % copies
    dest_rank = placement.replica_rank_ENM[flat_ids, flat_node, pick].reshape(T, K)
    dest_slot = placement.replica_slot_ENM[flat_ids, flat_node, pick].reshape(T, K)
    minus = torch.full_like(dest_rank, -1)
    return torch.where(valid_TK, dest_rank, minus), torch.where(valid_TK, dest_slot, minus)
