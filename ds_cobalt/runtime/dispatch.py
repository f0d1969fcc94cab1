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

`dispatch`/`combine` (no overlap): one count exchange over the EP group gives both stages' sizes
(`plan_layer`, the one host sync), rows and routes share one rail message: forward 5 collectives, backward 4.
With refillable spare slots (`step_spares`, stage 2 every step) sources choose only nodes, the count exchange
carries per-expert counts instead of per-slot ones, and each relay picks the copies after it.
The phases (`plan_rail`, `rail_payload`, `relay_routes`, `node_counts`) are shared with the overlapped
schedule in `overlap.py`, which exchanges counts per rail chunk and per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..kernels import dedup_pairs, gather_rows, weighted_scatter_add
from .comm import all_to_all_row_pair, all_to_all_rows, exchange_counts
from .placement import LayerPlacement, assign_nodes, assign_tasks, rank_within_key
from .step_spares import NodeSpares, StepFill, copy_of_routes, fill_step
from .sync_free import count_keys, device_ints, int_column
from .topology import EPGroups, Topology
from .traffic import ExchangeCounts

# Route metadata travels as fp32 (traffic.ROUTE_COLS columns); its integers are exact below 2**24
# (`plan_rail` checks).
_EXACT_FP32_INT = 1 << 24


@dataclass(frozen=True)
class RailPlan:
    """This rank's routes after task assignment, and the inter-node (rail) split sizes."""

    num_tokens: int
    dest_rank_TK: torch.Tensor | None  # [T, K] int64 EP rank serving each route, -1 = dropped; None: relays pick
    dest_slot_TK: torch.Tensor | None  # [T, K] int64 slot on that rank
    pair_token_P: torch.Tensor  # [P_out] token of each (token, remote node) pair, node-major
    route_t: torch.Tensor  # [R_out] token of each remote route, node-major
    route_k: torch.Tensor  # [R_out] its top-k column
    route_meta_R3: torch.Tensor  # [R_out, 3] metadata sent with the route (float32, exact integers)
    local_t: torch.Tensor  # [R_local] routes served on this node: token
    local_k: torch.Tensor  # [R_local] and top-k column
    rail_send: tuple[int, ...]  # pairs to each node's rail peer
    rail_recv: tuple[int, ...]
    route_send: tuple[int, ...]  # remote routes to each node
    route_recv: tuple[int, ...]
    expert_TK: torch.Tensor | None = None  # [T, K] int64 expert of each route, when relays pick the copies


@dataclass(frozen=True)
class RelayRoutes:
    """Routes a relay forwards inside its node, sorted by (destination local rank, slot)."""

    pool_R: torch.Tensor  # [R] int64 row in the relay's pool of token rows
    local_R: torch.Tensor  # [R] int64 destination local rank
    slot_R: torch.Tensor  # [R] int64 destination slot
    weight_R: torch.Tensor  # [R] gate weight (differentiable)


@dataclass(frozen=True)
class DispatchHandle:
    """Everything combine (and its backward) needs; produced by `dispatch`, consumed by `combine`."""

    num_tokens: int
    pair_token_P: torch.Tensor  # [P_out] int64 token of each (token, remote node) pair sent, node-major
    rail_send: tuple[int, ...]
    rail_recv: tuple[int, ...]
    relay: RelayRoutes
    node_send: tuple[int, ...]  # relay routes sent to each local rank
    node_recv: tuple[int, ...]  # rows received from each local rank
    expert_slot_Q: torch.Tensor  # [Q] int64 slot of each received row
    slot_counts: tuple[int, ...]  # [S] rows received per slot
    counts: ExchangeCounts  # split sizes of this exchange (the layer turns them into traffic)
    backend: str = "torch"  # kernel backend for combine


@dataclass(frozen=True)
class _Routes:
    """Task assignment and (token, remote node) dedup of one rank's routes, on the device."""

    dest_rank_TK: torch.Tensor | None  # None: only the node is chosen here (the relay picks the copy)
    dest_slot_TK: torch.Tensor | None
    dest_node_TK: torch.Tensor  # -1 = dropped
    remote_TK: torch.Tensor
    local_TK: torch.Tensor
    pair_token_P: torch.Tensor  # padded: the pairs first, cut once their count is on the host
    pair_index_TK: torch.Tensor
    rail_send_N: torch.Tensor  # pairs to each node
    route_send_N: torch.Tensor  # remote routes to each node


def _assigned_routes(topk_ids_TK: torch.Tensor, placement: LayerPlacement, groups: EPGroups, backend: str,
                     assignment: tuple[torch.Tensor, torch.Tensor] | None, nodes_only: bool = False) -> _Routes:
    topo = groups.topology
    T = topk_ids_TK.shape[0]
    N, G = topo.nodes, topo.ranks_per_node
    if T >= _EXACT_FP32_INT:
        raise ValueError(f"ds_cobalt: {T} tokens on one rank in one MoE call; at most {_EXACT_FP32_INT - 1} supported")
    if nodes_only:
        dest_rank_TK = dest_slot_TK = None
        dest_node_TK = assign_nodes(topk_ids_TK, placement, topo.rank)
        valid_TK = dest_node_TK >= 0
    else:
        dest_rank_TK, dest_slot_TK = assignment or assign_tasks(topk_ids_TK, placement, topo.rank)
        valid_TK = dest_rank_TK >= 0
        dest_node_TK = torch.where(valid_TK, dest_rank_TK // G, torch.full_like(dest_rank_TK, -1))
    remote_TK = valid_TK & (dest_node_TK != topo.node)
    pair_token_P, rail_send_N, pair_index_TK = dedup_pairs(dest_node_TK, topo.node, N, padded=True, backend=backend)
    route_send_N = torch.zeros(N, dtype=torch.int64, device=topk_ids_TK.device).scatter_add_(
        0, dest_node_TK.clamp(min=0).reshape(-1), remote_TK.reshape(-1).long())
    return _Routes(dest_rank_TK, dest_slot_TK, dest_node_TK, remote_TK, valid_TK & ~remote_TK, pair_token_P,
                   pair_index_TK, rail_send_N, route_send_N)


def _rail_plan(r: _Routes, groups: EPGroups, rail_send: tuple[int, ...], route_send: tuple[int, ...],
               rail_recv: tuple[int, ...], route_recv: tuple[int, ...], num_local: int,
               expert_TK: torch.Tensor | None = None) -> RailPlan:
    """Remote routes node-major (token order inside a node) and local routes in token order, as stable sorts
    cut at the exchanged sizes (no data-dependent `nonzero`). Route metadata: (row in the pair block,
    destination local rank, slot), or (row, expert, 0) when relays pick the copies (`expert_TK` given)."""
    N, G = groups.topology.nodes, groups.topology.ranks_per_node
    T, K = r.dest_node_TK.shape
    route_key = torch.where(r.remote_TK, r.dest_node_TK, torch.full_like(r.dest_node_TK, N)).reshape(-1)
    route_tk = torch.argsort(route_key, stable=True)[: sum(route_send)]
    route_t, route_k = route_tk // K, route_tk % K
    local_tk = torch.argsort((~r.local_TK).reshape(-1).to(torch.uint8), stable=True)[:num_local]
    local_t, local_k = local_tk // K, local_tk % K
    route_node = r.dest_node_TK[route_t, route_k]
    pair_start_N = torch.cumsum(r.rail_send_N, 0) - r.rail_send_N
    pair_row = r.pair_index_TK[route_t, route_k] - pair_start_N[route_node]
    if expert_TK is None:
        target = (r.dest_rank_TK[route_t, route_k] % G, r.dest_slot_TK[route_t, route_k])
    else:
        target = (expert_TK[route_t, route_k], torch.zeros_like(pair_row))
    route_meta_R3 = torch.stack([pair_row, *target], dim=1).to(torch.float32)
    return RailPlan(
        num_tokens=T, dest_rank_TK=r.dest_rank_TK, dest_slot_TK=r.dest_slot_TK,
        pair_token_P=r.pair_token_P[: sum(rail_send)],
        route_t=route_t, route_k=route_k, route_meta_R3=route_meta_R3, local_t=local_t, local_k=local_k,
        rail_send=rail_send, route_send=route_send, rail_recv=rail_recv, route_recv=route_recv, expert_TK=expert_TK,
    )


def plan_rail(topk_ids_TK: torch.Tensor, placement: LayerPlacement, groups: EPGroups,
              backend: str = "torch", assignment: tuple[torch.Tensor, torch.Tensor] | None = None) -> RailPlan:
    """Task assignment, (token, remote node) dedup and the rail count exchange (one host sync); the
    overlapped schedule's per-chunk plan (`plan_layer` also exchanges the node stage's counts).

    `backend`: kernel backend of `ds_cobalt.kernels` ("torch", "cupy" or "auto"). `assignment`: this call's
    `(dest_rank_TK, dest_slot_TK)` when already chosen (a chunk of a larger batch), else `assign_tasks`."""
    N = groups.topology.nodes
    r = _assigned_routes(topk_ids_TK, placement, groups, backend, assignment)
    counts_N2 = torch.stack([r.rail_send_N, r.route_send_N], 1)
    recv_counts_N2 = exchange_counts(counts_N2, groups.rail_group)
    host = torch.cat([counts_N2.reshape(-1), recv_counts_N2.reshape(-1),
                      r.local_TK.sum().reshape(1)]).tolist()  # NOTE: host sync
    return _rail_plan(r, groups, tuple(host[0: 2 * N: 2]), tuple(host[1: 2 * N: 2]),
                      tuple(host[2 * N: 4 * N: 2]), tuple(host[2 * N + 1: 4 * N: 2]), host[-1])


@dataclass(frozen=True)
class LayerPlan:
    """`plan_layer`'s result: the rail plan, both stages' split sizes and DeepSpeed's capacity."""

    rail: RailPlan
    send_GS: list[list[int]]  # rows this relay sends to each local rank, per slot
    recv_GS: list[list[int]]  # rows this expert rank receives from each local rank (relay), per slot
    capacity: int  # this rank's value of `capacity`, or the largest over the EP group (`reduce_capacity`)
    fill: StepFill | None = None  # this forward's refill of the node's spare slots (`spares` given)
    counts_WE: torch.Tensor | None = None  # [W, E] routes of each expert each source sends to this node


def plan_layer(topk_ids_TK: torch.Tensor, placement: LayerPlacement, groups: EPGroups, backend: str = "torch",
               capacity: torch.Tensor | int = 0, reduce_capacity: bool = False,
               spares: NodeSpares | None = None) -> LayerPlan:
    """Task assignment, dedup and one count exchange over the EP group for both stages (one host sync).

    Every source (n, g) sends each rank (m, g') its pair and route counts for node m and its route counts
    per (rank of node m, slot). Rank (m, g') then knows, as rail peer, what arrives on the rail; as relay,
    what it forwards to each local rank (sum over the sources with local index g'); as expert rank, what
    each relay g sends it (sum over the sources with local index g). `capacity` (a DeepSpeed gate's, for
    the counters) rides along; with `reduce_capacity` the largest over the group is returned.
    With `spares` the per-slot counts are replaced by per-expert ones (`_plan_layer_refilled`)."""
    if spares is not None:
        return _plan_layer_refilled(topk_ids_TK, placement, groups, backend, capacity, reduce_capacity, spares)
    topo = groups.topology
    N, G, W, S = topo.nodes, topo.ranks_per_node, topo.world_size, placement.slots_per_rank
    r = _assigned_routes(topk_ids_TK, placement, groups, backend, None)
    device = topk_ids_TK.device
    valid = r.dest_rank_TK.reshape(-1) >= 0
    slot_key = torch.where(valid, r.dest_rank_TK.reshape(-1) * S + r.dest_slot_TK.reshape(-1),
                           torch.full_like(valid, W * S, dtype=torch.int64))
    per_slot_NX = count_keys(slot_key, W * S).reshape(N, G * S)
    peer_node = torch.arange(W, device=device) // G
    cap = int_column(capacity, W, device)
    send_WF = torch.cat([r.rail_send_N[peer_node, None], r.route_send_N[peer_node, None], per_slot_NX[peer_node],
                         cap], 1)
    recv_NGF = exchange_counts(send_WF, groups.ep_group).reshape(N, G, -1)
    me = topo.local_rank
    blocks_NGGS = recv_NGF[:, :, 2: 2 + G * S].reshape(N, G, G, S)
    own_cap = recv_NGF[topo.node, me, -1:]
    host = torch.cat([
        r.rail_send_N, r.route_send_N, r.local_TK.sum().reshape(1),
        recv_NGF[:, me, 0], recv_NGF[:, me, 1],
        blocks_NGGS[:, me].sum(0).reshape(-1),  # relay: rows to each local rank, per slot
        blocks_NGGS[:, :, me].sum(0).reshape(-1),  # expert rank: rows from each relay, per slot
        recv_NGF[:, :, -1].max().reshape(1) if reduce_capacity else own_cap,
    ]).tolist()  # NOTE: host sync (the layer's only one)
    rail = _rail_plan(r, groups, tuple(host[:N]), tuple(host[N: 2 * N]), tuple(host[2 * N + 1: 3 * N + 1]),
                      tuple(host[3 * N + 1: 4 * N + 1]), host[2 * N])
    at = 4 * N + 1
    send_GS = [host[at + g * S: at + (g + 1) * S] for g in range(G)]
    at += G * S
    recv_GS = [host[at + g * S: at + (g + 1) * S] for g in range(G)]
    return LayerPlan(rail, send_GS, recv_GS, host[-1])


def _plan_layer_refilled(topk_ids_TK: torch.Tensor, placement: LayerPlacement, groups: EPGroups, backend: str,
                         capacity: torch.Tensor | int, reduce_capacity: bool, spares: NodeSpares) -> LayerPlan:
    """`plan_layer` with stage 2 every step: every source (n, g) sends each rank of node m its pair and route
    counts for node m and its route counts per expert there (for the experts node m holds); every rank of node m
    then holds the node's loads and refills the spare slots from them (`step_spares.fill_step`, the same on every
    rank of the node)."""
    topo = groups.topology
    N, G, W, E = topo.nodes, topo.ranks_per_node, topo.world_size, placement.num_experts
    r = _assigned_routes(topk_ids_TK, placement, groups, backend, None, nodes_only=True)
    device = topk_ids_TK.device
    expert_TK = topk_ids_TK.clamp(min=0).long()
    node = r.dest_node_TK.reshape(-1)
    key = torch.where(node >= 0, node * E + expert_TK.reshape(-1), torch.full_like(node, N * E))
    per_expert_NE = count_keys(key, N * E).reshape(N, E)
    held_NX = spares.held_NX
    X = held_NX.shape[1]
    per_held_NX = torch.cat([per_expert_NE, per_expert_NE.new_zeros(N, 1)], 1).gather(1, held_NX)  # pad: E -> 0
    peer_node = torch.arange(W, device=device) // G
    cap = int_column(capacity, W, device)
    send_WF = torch.cat([r.rail_send_N[peer_node, None], r.route_send_N[peer_node, None], per_held_NX[peer_node],
                         cap], 1)
    recv_WF = exchange_counts(send_WF, groups.ep_group)
    recv_NGF = recv_WF.reshape(N, G, -1)
    me = topo.local_rank
    counts_WE = recv_WF.new_zeros(W, E + 1).scatter_(1, held_NX[topo.node].expand(W, X), recv_WF[:, 2: 2 + X])
    counts_WE = counts_WE[:, :E]
    host = torch.cat([
        r.rail_send_N, r.route_send_N, r.local_TK.sum().reshape(1), recv_NGF[:, me, 0], recv_NGF[:, me, 1],
        counts_WE.reshape(N, G, E).sum(0).reshape(-1),  # routes of each expert through each relay
        recv_WF[:, -1].max().reshape(1) if reduce_capacity else recv_NGF[topo.node, me, -1:],
    ]).tolist()  # NOTE: host sync (the layer's only one)
    rail = _rail_plan(r, groups, tuple(host[:N]), tuple(host[N: 2 * N]), tuple(host[2 * N + 1: 3 * N + 1]),
                      tuple(host[3 * N + 1: 4 * N + 1]), host[2 * N], expert_TK)
    at = 4 * N + 1
    fill = fill_step(spares, np.asarray(host[at: at + G * E], dtype=np.int64).reshape(G, E), me, device)
    return LayerPlan(rail, fill.send_GS, fill.recv_GS, host[-1], fill, counts_WE)


def rail_payload(x_TD: torch.Tensor, weights_TK: torch.Tensor, plan: RailPlan,
                 backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """What goes on the rail: pair rows `[P_out, D]` and routes `[R_out, 4]` (metadata and gate weight)."""
    weight_R = weights_TK[plan.route_t, plan.route_k].float()
    return (gather_rows(x_TD, plan.pair_token_P, backend=backend),
            torch.cat([plan.route_meta_R3, weight_R.unsqueeze(1)], dim=1))


def relay_routes(plan: RailPlan, weights_TK: torch.Tensor, recv_routes_R4: torch.Tensor | None,
                 pool_offset: int, groups: EPGroups, slots: int, include_local: bool = True,
                 refill: tuple[StepFill, torch.Tensor] | None = None) -> RelayRoutes:
    """The relay's routes: its own tokens' routes on this node (pool rows = token index) and/or routes
    received on the rail (pool rows = `pool_offset` + received pair row), sorted by (local rank, slot).
    `refill`: this forward's `StepFill` and `counts_WE` (`LayerPlan`): the relay picks each route's copy."""
    G, N = groups.topology.ranks_per_node, groups.topology.nodes
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if include_local:
        t, k = plan.local_t, plan.local_k
        if refill is None:
            parts.append((t, plan.dest_rank_TK[t, k] % G, plan.dest_slot_TK[t, k], weights_TK[t, k]))
        else:  # (pool row, source rank, expert, weight): the copy is picked below
            parts.append((t, torch.full_like(t, groups.topology.rank), plan.expert_TK[t, k], weights_TK[t, k]))
    if recv_routes_R4 is not None:
        device = recv_routes_R4.device
        recv, route_recv = device_ints([plan.rail_recv, plan.route_recv], device)
        src_node = torch.repeat_interleave(torch.arange(N, device=device), route_recv,
                                           output_size=sum(plan.route_recv))
        meta = recv_routes_R4[:, :3].detach().long()
        pool = pool_offset + (recv.cumsum(0) - recv)[src_node] + meta[:, 0]
        second = meta[:, 1] if refill is None else src_node * G + groups.topology.local_rank
        parts.append((pool, second, meta[:, 1] if refill is not None else meta[:, 2], recv_routes_R4[:, 3]))
    pool_R, local_R, slot_R, weight_R = (torch.cat(cols) for cols in zip(*parts))
    if refill is not None:  # local_R, slot_R hold (source rank, expert) so far
        fill, counts_WE = refill
        src_R, expert_R = local_R, slot_R
        order_R = rank_within_key(src_R * counts_WE.shape[1] + expert_R)
        local_R, slot_R = copy_of_routes(fill, counts_WE, G, src_R, expert_R, order_R)
    order = torch.argsort(local_R * slots + slot_R, stable=True)
    return RelayRoutes(pool_R[order], local_R[order], slot_R[order], weight_R[order])


def node_counts(relay: RelayRoutes, groups: EPGroups, slots: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per (local rank, slot) rows this relay sends and receives: `send_GS`, `recv_GS` (one host sync)."""
    return node_counts_many([relay], groups, slots)[0]


def node_counts_many(relays: Sequence[RelayRoutes], groups: EPGroups,
                     slots: int) -> list[tuple[list[list[int]], list[list[int]]]]:
    """`node_counts` of several route sets in one exchange and one host sync."""
    G = groups.topology.ranks_per_node
    send_GnS = torch.stack([count_keys(r.local_R * slots + r.slot_R, G * slots).reshape(G, slots)
                            for r in relays], dim=1)
    recv_GnS = exchange_counts(send_GnS.reshape(G, -1), groups.node_group).reshape(send_GnS.shape)
    send, recv = torch.stack([send_GnS, recv_GnS]).tolist()  # NOTE: host sync
    return [([row[i] for row in send], [row[i] for row in recv]) for i in range(len(relays))]


def plan_counts(plan: RailPlan, node_send: Sequence[int], node_recv: Sequence[int],
                capacity: int = 0) -> ExchangeCounts:
    """The split sizes of one rail plan and its intra-node exchange."""
    return ExchangeCounts(tokens=plan.num_tokens, rail_send=plan.rail_send, rail_recv=plan.rail_recv,
                          route_send=plan.route_send, node_send=tuple(node_send), node_recv=tuple(node_recv),
                          deepspeed_capacity=capacity)


def dispatch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
             placement: LayerPlacement, groups: EPGroups, backend: str = "torch", capacity: torch.Tensor | int = 0,
             reduce_capacity: bool = False) -> tuple[torch.Tensor, DispatchHandle]:
    """Send token rows to the copies chosen by `assign_tasks`; return `[Q, D]` rows and the handle.

    `topk_ids_TK`: int, -1 = dropped route. `weights_TK`: gate weights (differentiable). Collectives: one count
    exchange, one rail message (rows with their routes), one node message; one host sync.
    """
    layer = plan_layer(topk_ids_TK, placement, groups, backend, capacity, reduce_capacity)
    return dispatch_planned(x_TD, weights_TK, layer, groups, placement.slots_per_rank, backend)


def dispatch_planned(x_TD: torch.Tensor, weights_TK: torch.Tensor, layer: LayerPlan, groups: EPGroups, S: int,
                     backend: str = "torch") -> tuple[torch.Tensor, DispatchHandle]:
    """`dispatch` after `plan_layer`: the rail message and the node message (S slots per rank)."""
    plan = layer.rail

    # Step 3: inter-node stage (rail): pair rows and their routes in one message.
    send_x, send_routes = rail_payload(x_TD, weights_TK, plan, backend)
    recv_x, recv_routes = all_to_all_row_pair(send_x, send_routes, (plan.rail_send, plan.route_send),
                                              (plan.rail_recv, plan.route_recv), groups.rail_group)

    # Step 4: relay routes = own tokens' routes on this node + routes received on the rail.
    relay = relay_routes(plan, weights_TK, recv_routes, plan.num_tokens, groups, S,
                         refill=None if layer.fill is None else (layer.fill, layer.counts_WE))

    # Step 5: intra-node stage; the counts exchanged in `plan_layer` give every split size.
    send_GS, recv_GS = layer.send_GS, layer.recv_GS
    node_send = tuple(sum(row) for row in send_GS)
    node_recv = tuple(sum(row) for row in recv_GS)
    slot_counts = tuple(sum(col) for col in zip(*recv_GS))
    pool_D = torch.cat([x_TD, recv_x])  # always, so every rank's backward runs the same collectives
    rows_QD = all_to_all_rows(gather_rows(pool_D, relay.pool_R, backend=backend), node_send, node_recv,
                              groups.node_group)
    # Rows arrive grouped by source, sorted by slot inside each: their slots follow from the counts.
    slot_Q = torch.repeat_interleave(torch.arange(S, device=x_TD.device).repeat(len(recv_GS)),
                                     device_ints(recv_GS, x_TD.device).reshape(-1), output_size=sum(node_recv))

    counts = plan_counts(plan, node_send, node_recv, layer.capacity)
    handle = DispatchHandle(plan.num_tokens, plan.pair_token_P, plan.rail_send, plan.rail_recv, relay,
                            node_send, node_recv, slot_Q, slot_counts, counts, backend)
    return rows_QD, handle


def weighted_sum(rows_RD: torch.Tensor, weight_R: torch.Tensor, index_R: torch.Tensor, num_out: int,
                 backend: str = "torch") -> torch.Tensor:
    """`out[index[r]] += weight[r] * rows[r]`, accumulated in fp32, returned in the rows' dtype."""
    return weighted_scatter_add(rows_RD, index_R, weight_R, num_out, backend=backend)


def combine(expert_out_QD: torch.Tensor, handle: DispatchHandle, groups: EPGroups) -> torch.Tensor:
    """Weighted sum of every route's expert output per token, `[T, D]` in the experts' dtype.

    Sums stay in fp32 and are rounded once, like DeepSpeed's combine; only the per-(token, node) partial
    sums are rounded to the experts' dtype for their trip over the rail."""
    back_RD = all_to_all_rows(expert_out_QD, handle.node_recv, handle.node_send, groups.node_group)
    pooled = weighted_sum(back_RD.float(), handle.relay.weight_R, handle.relay.pool_R,
                          handle.num_tokens + sum(handle.rail_recv), handle.backend)
    return return_to_sources(pooled[: handle.num_tokens], pooled[handle.num_tokens:].to(expert_out_QD.dtype),
                             handle.pair_token_P, handle.rail_send, handle.rail_recv, groups)


def return_to_sources(own_TD: torch.Tensor, relayed_PD: torch.Tensor, pair_token_P: torch.Tensor,
                      rail_send: Sequence[int], rail_recv: Sequence[int], groups: EPGroups) -> torch.Tensor:
    """One row per (token, remote node) back over the rail, added to the tokens' own-node sums (fp32);
    the result is in the dtype of `relayed_PD`."""
    returned_PD = all_to_all_rows(relayed_PD, rail_recv, rail_send, groups.rail_group)
    return own_TD.float().index_add(0, pair_token_P, returned_PD.float()).to(relayed_PD.dtype)


def deepspeed_remote_routes(topk_ids_TK: torch.Tensor, num_experts: int, topo: Topology) -> torch.Tensor:
    """Routes whose expert sits on another node under DeepSpeed's contiguous placement (`[1]` int64, on the
    device: for the counters, read only when they are)."""
    per_rank = num_experts // topo.world_size
    ds_node = torch.div(topk_ids_TK.clamp(min=0), per_rank * topo.ranks_per_node, rounding_mode="floor")
    return ((topk_ids_TK >= 0) & (ds_node != topo.node)).sum().reshape(1)
