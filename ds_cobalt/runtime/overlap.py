"""Fine-grained compute/communication overlap for one MoE layer (forward and backward).

Legend: T tokens, K routes, D hidden, G ranks per node, S slots per rank, R relay routes, P pairs.

Schedule of `overlapped_moe` (C = `rail_chunks`):
1. the tokens are cut into C chunks for the rail (inter-node); every chunk's (token, remote node) rows
   start on the rail asynchronously;
2. the own-node routes are cut by token into C + 1 parts, and the rounds run A_0, B_0, A_1, B_1, ..., A_C:
   round A_c computes own-node part c while rail chunk c travels; round B_c computes the routes that
   arrived in chunk c, and its one row per (token, node) starts back on the rail at once; A_C computes
   while the last results travel back;
3. inside every round the intra-node exchange is split by source rank and into tiles of at most
   `tile_rows` rows; the expert rank computes its own rows first, then each tile as soon as its receive
   completes, and sends each finished tile back while later tiles compute (point-to-point work handles,
   no barrier).
Backward mirrors it: gradient tiles are computed as they land and input gradients leave as soon as each
is ready; the rail gradients travel asynchronously, behind the A rounds' backward (`_Landed` starts a
trip, `_GradReady`, placed earlier in the forward, collects it). Results equal `dispatch` -> `run_experts`
-> `combine` up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.distributed as dist
from torch.func import functional_call

from ..kernels import gather_rows
from .comm import group_capacity
from .dispatch import (
    RailPlan,
    RelayRoutes,
    node_counts,
    node_counts_many,
    plan_counts,
    plan_rail,
    rail_payload,
    relay_routes,
    weighted_sum,
)
from .placement import LayerPlacement, assign_tasks
from .topology import EPGroups
from .traffic import ExchangeCounts

_ROWS, _OUT, _GRAD, _GRAD_IN = 1, 2, 3, 4  # message kinds; tag = kind << 16 | tile


@dataclass(frozen=True)
class SlotExpert:
    """The expert in one slot: a module applied with the given parameter tensors (owner parameters, or
    replica weights fetched from the owner)."""

    module: torch.nn.Module
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    own_module: torch.nn.Module | None = None  # a module whose own parameters are `tensors` (called directly)


@dataclass(frozen=True)
class _Exchange:
    send_GS: list[list[int]]  # rows this relay sends to each local rank, per slot
    recv_GS: list[list[int]]  # rows this expert rank receives from each local rank, per slot
    me: int
    peer_ranks: tuple[int, ...]  # global rank of each local rank
    group: dist.ProcessGroup | None
    tile_rows: int
    slots: tuple[SlotExpert | None, ...]


def _tiles(rows: int, tile_rows: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile_rows, rows)) for a in range(0, rows, tile_rows)]


def _tile_slot_counts(counts_S: Sequence[int], a: int, b: int) -> list[int]:
    """Rows of each slot inside rows [a, b) of a block sorted by slot with per-slot sizes `counts_S`."""
    out, start = [], 0
    for count in counts_S:
        out.append(max(0, min(b, start + count) - max(a, start)))
        start += count
    return out


def _chunked_exchange(spec: _Exchange, rows_RD: torch.Tensor, kinds: tuple[int, int], work_on) -> torch.Tensor:
    """Send this relay's blocks to their local ranks in tiles; run `work_on(peer, tile, rows, a, b)` on the own
    block first, then on each incoming tile as it lands, sending each result straight back; return the
    results of this relay's rows, in their order. `kinds`: message kinds of the rows and of the results."""
    send_n = [sum(row) for row in spec.send_GS]
    recv_n = [sum(row) for row in spec.recv_GS]
    blocks = rows_RD.split(send_n)
    D = rows_RD.shape[1]
    outbound, inbound = kinds
    peers = [(spec.me + i) % len(send_n) for i in range(1, len(send_n))]
    incoming = [(p, i, a, b, _recv(rows_RD.new_empty(b - a, D), spec, p, outbound, i))
                for p in peers for i, (a, b) in enumerate(_tiles(recv_n[p], spec.tile_rows))]
    results = {p: [_recv(rows_RD.new_empty(b - a, D), spec, p, inbound, i)
                   for i, (a, b) in enumerate(_tiles(send_n[p], spec.tile_rows))] for p in peers}
    sends = [_send(blocks[p][a:b], spec, p, outbound, i)
             for p in peers for i, (a, b) in enumerate(_tiles(send_n[p], spec.tile_rows))]
    own = work_on(spec.me, 0, blocks[spec.me], 0, send_n[spec.me])
    for p, i, a, b, (buf, _) in _as_they_land(incoming):
        sends.append(_send(work_on(p, i, buf, a, b), spec, p, inbound, i))
    pieces = [own if d == spec.me else torch.cat([_wait(r) for r in results[d]] or [own[:0]])
              for d in range(len(send_n))]
    for _, work in sends:
        work.wait()
    return torch.cat(pieces)


class _ExpertExchange(torch.autograd.Function):
    """Relay rows `[R, D]` (sorted by destination local rank, slot) -> expert outputs `[R, D]`, chunked."""

    @staticmethod
    def forward(ctx, spec: _Exchange, rows_RD: torch.Tensor, *tensors: torch.Tensor):  # type: ignore[override]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        slot_leaves = _split_by_slot(spec.slots, leaves)
        chunks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}

        def compute(peer: int, tile: int, rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
            counts_S = _tile_slot_counts(spec.recv_GS[peer], a, b)
            return _compute(spec, slot_leaves, rows, counts_S, chunks, (peer, tile))

        out = _chunked_exchange(spec, rows_RD, (_ROWS, _OUT), compute)
        ctx.spec, ctx.chunks, ctx.slot_leaves, ctx.leaves = spec, chunks, slot_leaves, leaves
        return out

    @staticmethod
    def backward(ctx, grad_RD):  # type: ignore[override]
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.leaves)

        def backprop(peer: int, tile: int, grad_rows: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return _backprop(ctx, ctx.chunks.get((peer, tile)), grad_rows, param_grads)

        grad_rows_RD = _chunked_exchange(ctx.spec, grad_RD.contiguous(), (_GRAD, _GRAD_IN), backprop)
        param_grads = [torch.zeros_like(leaf) if g is None and leaf.requires_grad else g
                       for g, leaf in zip(param_grads, ctx.leaves)]
        return (None, grad_rows_RD, *param_grads)


def _split_by_slot(slots: Sequence[SlotExpert | None], leaves: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out, start = [], 0
    for slot in slots:
        n = 0 if slot is None else len(slot.tensors)
        out.append(leaves[start: start + n])
        start += n
    return out


def _recv(buf: torch.Tensor, spec: _Exchange, peer: int, kind: int, tile: int):
    return buf, dist.irecv(buf, src=spec.peer_ranks[peer], group=spec.group, tag=kind << 16 | tile)


def _send(rows: torch.Tensor, spec: _Exchange, peer: int, kind: int, tile: int):
    rows = rows.contiguous()  # kept alive with the work handle until it completes
    return rows, dist.isend(rows, dst=spec.peer_ranks[peer], group=spec.group, tag=kind << 16 | tile)


def _wait(item) -> torch.Tensor:
    buf, work = item
    work.wait()
    return buf


def _as_they_land(pending: list):
    """Yield pending receives in completion order (the oldest one when none has completed yet)."""
    pending = list(pending)
    while pending:
        item = next((it for it in pending if it[-1][1].is_completed()), pending[0])
        pending.remove(item)
        item[-1][1].wait()
        yield item


def _compute(spec: _Exchange, slot_leaves: list[list[torch.Tensor]], rows: torch.Tensor,
             counts_S: Sequence[int], chunks: dict, key: tuple[int, int]) -> torch.Tensor:
    """Apply each slot's expert to its rows of one chunk; keep the graph for backward."""
    if rows.shape[0] == 0:
        return rows
    with torch.enable_grad():
        rows_in = rows.detach().requires_grad_(True)
        outs, used = [], []
        for s, part in enumerate(rows_in.split(list(counts_S))):
            if part.shape[0] == 0:
                continue
            slot = spec.slots[s]
            assert slot is not None, f"rows routed to empty slot {s}"
            out = functional_call(slot.module, dict(zip(slot.names, slot_leaves[s])), (part,))
            outs.append(out[0] if isinstance(out, tuple) else out)
            used.append(s)
        out = torch.cat(outs)
    chunks[key] = (rows_in, out, used)
    return out.detach()


def _backprop(ctx, chunk, grad_rows: torch.Tensor, param_grads: list) -> torch.Tensor:
    """Gradient of one chunk's inputs; parameter gradients are added into `param_grads`."""
    if chunk is None:
        return grad_rows.new_zeros(grad_rows.shape)
    rows_in, out, used = chunk
    leaves = [leaf for s in used for leaf in ctx.slot_leaves[s] if leaf.requires_grad]
    grads = torch.autograd.grad(out, [rows_in, *leaves], grad_rows, allow_unused=True)
    index = {id(leaf): j for j, leaf in enumerate(ctx.leaves)}
    for leaf, g in zip(leaves, grads[1:]):
        if g is not None:
            j = index[id(leaf)]
            param_grads[j] = g if param_grads[j] is None else param_grads[j] + g
    return grads[0]


def expert_exchange(rows_RD: torch.Tensor, send_GS: list[list[int]], recv_GS: list[list[int]],
                    slots: Sequence[SlotExpert | None], groups: EPGroups, tile_rows: int) -> torch.Tensor:
    """Chunked intra-node exchange with expert compute; `[R, D]` outputs in the relay's route order."""
    topo = groups.topology
    node_base = topo.node * topo.ranks_per_node
    spec = _Exchange(send_GS, recv_GS, topo.local_rank,
                     tuple(groups.ep_ranks[node_base + g] for g in range(topo.ranks_per_node)),
                     groups.node_group, max(1, tile_rows), tuple(slots))
    tensors = [t for slot in slots if slot is not None for t in slot.tensors]
    return _ExpertExchange.apply(spec, rows_RD, *tensors)


# ----- asynchronous rail transfer -------------------------------------------------------------------
class _Inflight:
    """An all-to-all started with async_op=True; `buffer` is valid after `work.wait()`."""

    def __init__(self, rows: torch.Tensor, send: Sequence[int], recv: Sequence[int],
                 group: dist.ProcessGroup | None) -> None:
        self.send, self.recv, self.group = tuple(send), tuple(recv), group
        rows = rows.detach().contiguous()
        self.buffer = rows.new_empty((sum(recv), *rows.shape[1:]))
        self._keep = rows
        self.work = (None if group is None else
                     dist.all_to_all_single(self.buffer, rows, list(recv), list(send), group=group, async_op=True))
        if group is None:
            self.buffer = rows

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buffer


class _Mailbox:
    """Where a backward all-to-all started by `_Landed` leaves its result for the matching `_GradReady`."""

    def __init__(self) -> None:
        self.work = None
        self.buffer: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None


class _Landed(torch.autograd.Function):
    """Joins an in-flight all-to-all to autograd. Forward waits for it; backward starts the gradients' trip
    back asynchronously and passes on a zero placeholder: the gradients reach autograd at `_GradReady`."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, inflight: _Inflight, mailbox: _Mailbox):  # type: ignore[override]
        ctx.inflight, ctx.mailbox = inflight, mailbox
        return inflight.wait().clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        f, box = ctx.inflight, ctx.mailbox
        if f.group is None:
            return grad, None, None
        box.keep = grad.contiguous()
        box.buffer = grad.new_empty((sum(f.send), *grad.shape[1:]))
        box.work = dist.all_to_all_single(box.buffer, box.keep, list(f.send), list(f.recv), group=f.group,
                                          async_op=True)
        return grad.new_zeros(()).expand(box.buffer.shape), None, None


class _GradReady(torch.autograd.Function):
    """Identity; its backward waits for the gradients `_Landed` sent and returns them. Autograd runs nodes
    created later first, so placing this node earlier in the forward than the work that should overlap the
    trip (e.g. before round A1) makes backward run that work while the gradients travel."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, mailbox: _Mailbox):  # type: ignore[override]
        ctx.mailbox = mailbox
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        box = ctx.mailbox
        if box.work is None:  # no group: `_Landed` passed the real gradient through
            return grad, None
        box.work.wait()
        out, box.work, box.buffer, box.keep = box.buffer, None, None, None
        return out, None


def _select(relay: RelayRoutes, keep_R: torch.Tensor) -> RelayRoutes:
    # NOTE: host sync (boolean-mask selection, once per own-node round; the overlapped schedule only)
    return RelayRoutes(relay.pool_R[keep_R], relay.local_R[keep_R], relay.slot_R[keep_R], relay.weight_R[keep_R])


def _own_routes(plans: Sequence[RailPlan], spans: Sequence[tuple[int, int]], weights_TK: torch.Tensor,
                groups: EPGroups, slots: int) -> RelayRoutes:
    """This rank's own-node routes over all chunks, pool rows = token index, sorted by (local rank, slot)."""
    parts = [relay_routes(plan, weights_TK[a:b], None, 0, groups, slots) for plan, (a, b) in zip(plans, spans)]
    pool_R = torch.cat([r.pool_R + a for r, (a, _) in zip(parts, spans)])
    local_R, slot_R, weight_R = (torch.cat(cols) for cols in zip(*((r.local_R, r.slot_R, r.weight_R) for r in parts)))
    order = torch.argsort(local_R * slots + slot_R, stable=True)
    return RelayRoutes(pool_R[order], local_R[order], slot_R[order], weight_R[order])


def _local_round(pool_D: torch.Tensor, relay: RelayRoutes, num_out: int, slots: Sequence[SlotExpert | None],
                 groups: EPGroups, tile_rows: int, counts: list, backend: str,
                 known: tuple[list[list[int]], list[list[int]]] | None = None) -> torch.Tensor:
    """Intra-node exchange + experts + weighted sum per pool row for one set of relay routes (`known`: its
    `node_counts`, when already exchanged)."""
    send_GS, recv_GS = known or node_counts(relay, groups, len(slots))
    counts.append((send_GS, recv_GS))
    rows_RD = gather_rows(pool_D, relay.pool_R, backend=backend)
    out_RD = expert_exchange(rows_RD, send_GS, recv_GS, slots, groups, tile_rows)
    return weighted_sum(out_RD.float(), relay.weight_R, relay.pool_R, num_out, backend)  # fp32 sums


@dataclass
class _RailChunk:
    """One token chunk's trip over the rail: rows and routes out (started at once), relayed sums back."""

    span: tuple[int, int]
    plan: RailPlan
    send_x: torch.Tensor
    send_routes: torch.Tensor
    inflight_x: _Inflight
    inflight_routes: _Inflight
    box_x: _Mailbox
    box_routes: _Mailbox
    back: tuple[_Inflight, _Mailbox, torch.Tensor] | None = None


def _start_chunk(x_TD: torch.Tensor, weights_TK: torch.Tensor, plan: RailPlan, span: tuple[int, int],
                 rail: dist.ProcessGroup | None, backend: str) -> _RailChunk:
    a, b = span
    send_x, send_routes = rail_payload(x_TD[a:b], weights_TK[a:b], plan, backend)
    # backward: these rows' gradients come back while the own-node rounds' backward runs
    box_x, box_routes = _Mailbox(), _Mailbox()
    send_x, send_routes = _GradReady.apply(send_x, box_x), _GradReady.apply(send_routes, box_routes)
    return _RailChunk(span, plan, send_x, send_routes,
                      _Inflight(send_x, plan.rail_send, plan.rail_recv, rail),
                      _Inflight(send_routes, plan.route_send, plan.route_recv, rail), box_x, box_routes)


def overlapped_moe(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                   placement: LayerPlacement, groups: EPGroups, slots: Sequence[SlotExpert | None],
                   tile_rows: int, backend: str = "torch",
                   rail_chunks: int = 2,
                   capacity: tuple[torch.Tensor | int, bool] = (0, False)) -> tuple[torch.Tensor, ExchangeCounts]:
    """The whole MoE exchange with overlap; `[T, D]` combined outputs and the exchange's split sizes (module
    docstring). `capacity`: DeepSpeed's capacity for the counters, and whether it is this rank's value."""
    S = placement.slots_per_rank
    T = x_TD.shape[0]
    C = max(1, int(rail_chunks))
    rail = groups.rail_group
    dest_rank_TK, dest_slot_TK = assign_tasks(topk_ids_TK, placement, groups.topology.rank)
    bounds = [T * c // C for c in range(C + 1)]
    spans = list(zip(bounds[:-1], bounds[1:]))
    # every chunk's count exchange first: a blocking exchange would otherwise queue behind a transfer
    plans = [plan_rail(topk_ids_TK[a:b], placement, groups, backend, (dest_rank_TK[a:b], dest_slot_TK[a:b]))
             for a, b in spans]
    chunks = [_start_chunk(x_TD, weights_TK, plan, span, rail, backend) for plan, span in zip(plans, spans)]

    relay_own = _own_routes(plans, spans, weights_TK, groups, S)
    part_of_R = relay_own.pool_R * (C + 1) // max(1, T)  # own-node part of each route, by token
    own_parts = [_select(relay_own, part_of_R == p) for p in range(C + 1)]
    own_counts = node_counts_many(own_parts, groups, S)  # one exchange for every own-node round
    counts: list = []
    own_TD = None

    def own_part(p: int) -> None:
        nonlocal own_TD
        part = _local_round(x_TD, own_parts[p], T, slots, groups, tile_rows, counts, backend, own_counts[p])
        own_TD = part if own_TD is None else own_TD + part

    for c, ch in enumerate(chunks):
        own_part(c)  # round A_c, while chunk c (and later ones) travel
        recv_x = _Landed.apply(ch.send_x, ch.inflight_x, ch.box_x)
        recv_routes = _Landed.apply(ch.send_routes, ch.inflight_routes, ch.box_routes)
        a, b = ch.span
        relay_b = relay_routes(ch.plan, weights_TK[a:b], recv_routes, 0, groups, S, include_local=False)
        relayed_PD = _local_round(recv_x, relay_b, sum(ch.plan.rail_recv), slots, groups, tile_rows, counts,
                                  backend).to(x_TD.dtype)  # round B_c, rounded once for the trip back
        box_back = _Mailbox()
        relayed_PD = _GradReady.apply(relayed_PD, box_back)  # backward: later rounds run while these travel
        ch.back = (_Inflight(relayed_PD, ch.plan.rail_recv, ch.plan.rail_send, rail), box_back, relayed_PD)
    own_part(C)  # round A_C, while the last results travel back

    out_TD = own_TD
    for ch in chunks:
        inflight_back, box_back, relayed_PD = ch.back
        returned_PD = _Landed.apply(relayed_PD, inflight_back, box_back)
        out_TD = out_TD.index_add(0, ch.plan.pair_token_P + ch.span[0], returned_PD.float())
    out_TD = out_TD.to(x_TD.dtype)

    G = groups.topology.ranks_per_node
    node_send = [sum(row) for send_GS, _ in counts for row in send_GS]
    node_recv = [sum(row) for _, recv_GS in counts for row in recv_GS]
    node = (tuple(sum(node_send[g::G]) for g in range(G)), tuple(sum(node_recv[g::G]) for g in range(G)))
    zero = ((0,) * G, (0,) * G)
    parts = [plan_counts(plan, *(node if i == 0 else zero)) for i, plan in enumerate(plans)]
    capacity_C = group_capacity(*capacity, groups.ep_group, x_TD.device)  # the overlapped schedule's counters
    return out_TD, replace(ExchangeCounts.total(parts), deepspeed_capacity=capacity_C)
