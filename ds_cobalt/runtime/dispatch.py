"""Two-stage, deduplicating token dispatch and combine.

Legend: T tokens on this rank, K routes per token, D hidden size, N nodes, G ranks per node,
P (token, remote node) pairs, R routes, Q rows at an expert rank, S slots per rank.

Dispatch (source rank on node n, local index g):
  inter-node: each token goes once to each remote node it needs, to the rail peer (m, g), together
  with the metadata of its routes there (row, destination local rank, slot) and their gate weights;
  intra-node: every rank (as relay) forwards rows of its own tokens and of the tokens it received to
  the local ranks holding the chosen copies.
Combine mirrors it: experts' outputs return to the relay, which sums the weighted outputs of every
expert that served a token on its node, and one row per (token, remote node) returns to the source.
Backward reuses the plan through autograd (every all-to-all is differentiable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import all_to_all_ints, all_to_all_rows, exchange_counts
from .placement import LayerPlacement, assign_tasks
from .topology import EPGroups
from .traffic import StepTraffic

_META_COLS = 3  # (row within the source's block, destination local rank, destination slot)


@dataclass(frozen=True)
class DispatchHandle:
    """Everything combine (and its backward) needs; produced by `dispatch`, consumed by `combine`."""

    num_tokens: int
    pair_token_P: torch.Tensor  # [P_out] int64 token of each (token, remote node) pair sent, node-major
    rail_send: tuple[int, ...]  # pairs sent to each node's rail peer
    rail_recv: tuple[int, ...]  # pairs received from each node's rail peer
    relay_pool_R: torch.Tensor  # [R] int64 row in the relay pool (own tokens, then received pairs)
    relay_weight_R: torch.Tensor  # [R] gate weight of each relay route, in send order
    node_send: tuple[int, ...]  # relay routes sent to each local rank
    node_recv: tuple[int, ...]  # rows received from each local rank
    expert_slot_Q: torch.Tensor  # [Q] int64 slot of each received row
    slot_counts: tuple[int, ...]  # [S] rows received per slot
    traffic: StepTraffic


def dispatch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
             placement: LayerPlacement, groups: EPGroups,
             deepspeed_capacity: int) -> tuple[torch.Tensor, DispatchHandle]:
    """Send token rows to the copies chosen by `assign_tasks`; return `[Q, D]` rows and the handle.

    `topk_ids_TK`: int, -1 = dropped route. `weights_TK`: gate weights (differentiable).
    `deepspeed_capacity`: the C of DeepSpeed's padded E x C buffers, only for the traffic counters.
    """
    topo = groups.topology
    T, K = topk_ids_TK.shape
    N, G, S = topo.nodes, topo.ranks_per_node, placement.slots_per_rank
    device = x_TD.device
    dest_rank_TK, dest_slot_TK = assign_tasks(topk_ids_TK, placement, topo.rank)
    valid_TK = dest_rank_TK >= 0
    dest_node_TK = torch.where(valid_TK, dest_rank_TK // G, torch.full_like(dest_rank_TK, -1))
    remote_TK = valid_TK & (dest_node_TK != topo.node)

    # Step 1: (token, remote node) pairs, node-major, and the remote routes in the same node order.
    route_t, route_k = remote_TK.nonzero(as_tuple=True)
    route_node = dest_node_TK[route_t, route_k]
    by_node = torch.argsort(route_node, stable=True)
    route_t, route_k, route_node = route_t[by_node], route_k[by_node], route_node[by_node]
    pair_NT = torch.zeros((N, T), dtype=torch.bool, device=device)
    pair_NT[route_node, route_t] = True
    pair_node, pair_token_P = pair_NT.nonzero(as_tuple=True)
    rail_send_N = pair_NT.sum(1)
    pair_start_N = torch.cumsum(rail_send_N, 0) - rail_send_N
    pair_pos_NT = torch.cumsum(pair_NT.reshape(-1), 0).reshape(N, T) - 1
    route_meta_R3 = torch.stack([
        pair_pos_NT[route_node, route_t] - pair_start_N[route_node],
        dest_rank_TK[route_t, route_k] % G,
        dest_slot_TK[route_t, route_k],
    ], dim=1).to(torch.int32)  # int32 halves the metadata bytes on the slow link
    route_send_N = torch.bincount(route_node, minlength=N)

    # Step 2: count exchange on the rail, with DeepSpeed's would-be remote routes for the counters.
    ds_remote = _deepspeed_remote_routes(topk_ids_TK, placement.num_experts, topo)
    counts_N3 = torch.stack([rail_send_N, route_send_N, ds_remote.expand(N)], 1)
    recv_counts_N3 = exchange_counts(counts_N3[:, :2].contiguous(), groups.rail_group)
    host = torch.cat([counts_N3.reshape(-1), recv_counts_N3.reshape(-1)]).tolist()  # NOTE: host sync
    rail_send = tuple(host[0: 3 * N: 3])
    route_send = tuple(host[1: 3 * N: 3])
    ds_remote_routes = host[2]
    rail_recv = tuple(host[3 * N::2])
    route_recv = tuple(host[3 * N + 1::2])

    # Step 3: inter-node stage (rail).
    recv_x = all_to_all_rows(x_TD[pair_token_P], rail_send, rail_recv, groups.rail_group)
    recv_meta_R3 = all_to_all_ints(route_meta_R3, route_send, route_recv, groups.rail_group).long()
    recv_w_R = all_to_all_rows(weights_TK[route_t, route_k], route_send, route_recv, groups.rail_group)

    # Step 4: relay routes = own tokens' routes on this node + routes received on the rail.
    local_t, local_k = (valid_TK & ~remote_TK).nonzero(as_tuple=True)
    recv_start_N = torch.tensor(rail_recv, device=device).cumsum(0) - torch.tensor(rail_recv, device=device)
    recv_src_node = torch.repeat_interleave(torch.arange(N, device=device), torch.tensor(route_recv, device=device))
    relay_pool = torch.cat([local_t, T + recv_start_N[recv_src_node] + recv_meta_R3[:, 0]])
    relay_local = torch.cat([dest_rank_TK[local_t, local_k] % G, recv_meta_R3[:, 1]])
    relay_slot = torch.cat([dest_slot_TK[local_t, local_k], recv_meta_R3[:, 2]])
    relay_weight = torch.cat([weights_TK[local_t, local_k], recv_w_R])
    order = torch.argsort(relay_local * S + relay_slot, stable=True)
    relay_pool, relay_local, relay_slot, relay_weight = (
        relay_pool[order], relay_local[order], relay_slot[order], relay_weight[order])

    # Step 5: intra-node stage; per-(local rank, slot) counts give the expert ranks their slot sizes.
    send_GS = torch.bincount(relay_local * S + relay_slot, minlength=G * S).reshape(G, S)
    recv_GS = exchange_counts(send_GS, groups.node_group)
    host = torch.cat([send_GS.sum(1), recv_GS.sum(1), recv_GS.sum(0)]).tolist()  # NOTE: host sync
    node_send, node_recv, slot_counts = tuple(host[:G]), tuple(host[G: 2 * G]), tuple(host[2 * G:])
    pool_D = torch.cat([x_TD, recv_x])  # always, so every rank's backward runs the same collectives
    rows_QD = all_to_all_rows(pool_D[relay_pool], node_send, node_recv, groups.node_group)
    slot_Q = all_to_all_ints(relay_slot, node_send, node_recv, groups.node_group)

    row_bytes = x_TD.shape[1] * x_TD.element_size()
    traffic = StepTraffic.measure(
        row_bytes=row_bytes, topology=topo, experts_per_rank=placement.owner_slots_per_rank,
        pairs_sent=sum(rail_send), pairs_received=sum(rail_recv),
        routes_sent=sum(route_send), meta_bytes_per_route=_META_COLS * route_meta_R3.element_size() + 4,
        node_send=node_send, node_recv=node_recv, deepspeed_capacity=deepspeed_capacity,
        deepspeed_remote_routes=ds_remote_routes, tokens=T,
    )
    handle = DispatchHandle(T, pair_token_P, rail_send, rail_recv, relay_pool, relay_weight, node_send, node_recv,
                            slot_Q, slot_counts, traffic)
    return rows_QD, handle


def combine(expert_out_QD: torch.Tensor, handle: DispatchHandle, groups: EPGroups) -> torch.Tensor:
    """Weighted sum of every route's expert output per token, `[T, D]` in the experts' dtype."""
    back_RD = all_to_all_rows(expert_out_QD, handle.node_recv, handle.node_send, groups.node_group)
    contrib_RD = back_RD.float() * handle.relay_weight_R.float().unsqueeze(1)
    pool_rows = handle.num_tokens + sum(handle.rail_recv)
    pooled = contrib_RD.new_zeros((pool_rows, back_RD.shape[1])).index_add(0, handle.relay_pool_R, contrib_RD)
    pooled = pooled.to(expert_out_QD.dtype)
    returned_PD = all_to_all_rows(pooled[handle.num_tokens:], handle.rail_recv, handle.rail_send, groups.rail_group)
    return pooled[: handle.num_tokens].index_add(0, handle.pair_token_P, returned_PD)


def _deepspeed_remote_routes(topk_ids_TK: torch.Tensor, num_experts: int, topo) -> torch.Tensor:
    """Routes whose expert sits on another node under DeepSpeed's contiguous placement (0-d int64)."""
    per_rank = num_experts // topo.world_size
    ds_node = torch.div(topk_ids_TK.clamp(min=0), per_rank * topo.ranks_per_node, rounding_mode="floor")
    return ((topk_ids_TK >= 0) & (ds_node != topo.node)).sum().reshape(1)
