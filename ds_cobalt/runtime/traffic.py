"""Exact traffic counters of one forward pass (dispatch + combine), and their running totals.

The exchange reports its split sizes (`ExchangeCounts`, already on the host for the collectives); the layer
turns them into bytes (`StepTraffic.measure`) outside the exchange, so counting costs no extra sync.
DeepSpeed's would-be cross-node routes are counted on the device and read only when totals are asked for.
Backward sends the same volumes again in reverse; DeepSpeed's does too, so ratios hold for a step.
Replica weights are in the byte counts too: each spare slot's owner sends the expert's parameters in forward and
the replica's holder returns their gradient in backward, so a rank sends its own share of the two; it is counted
half in each forward, so that twice the forward counters are the step, as for token rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

# A remote route travels as one fp32 row (row within the source's block, destination local rank,
# destination slot, gate weight): one differentiable message for metadata and weights.
ROUTE_COLS = 4
META_BYTES_PER_ROUTE = ROUTE_COLS * 4
SLOT_ID_BYTES = 0  # slots are implied: relays send rows sorted by slot and the counts are exchanged


@dataclass(frozen=True)
class ExchangeCounts:
    """Split sizes of one forward's exchange on this rank (host ints, known to the collectives anyway).

    Rail stage: one entry per rail peer (per node for the hierarchical schedule, per EP rank for the direct one).
    Node stage: one entry per local rank of the node group (one entry, this rank, for the direct schedule)."""

    tokens: int
    rail_send: tuple[int, ...]  # token rows sent to each rail peer (each returns one combined row)
    rail_recv: tuple[int, ...]  # token rows received from each rail peer
    route_send: tuple[int, ...]  # remote routes' metadata rows sent to each rail peer
    node_send: tuple[int, ...]  # rows sent to each local rank (this one included)
    node_recv: tuple[int, ...]  # rows received from each local rank
    deepspeed_capacity: int = 0  # C of DeepSpeed's padded E x C buffers for this forward (0 = none)

    @staticmethod
    def total(parts: Sequence["ExchangeCounts"]) -> "ExchangeCounts":
        """Counts of several exchanges of one forward (e.g. rail chunks and overlap rounds) added up."""
        def add(name: str) -> tuple[int, ...]:
            return tuple(map(sum, zip(*(getattr(p, name) for p in parts))))

        return ExchangeCounts(tokens=sum(p.tokens for p in parts), rail_send=add("rail_send"),
                              rail_recv=add("rail_recv"), route_send=add("route_send"), node_send=add("node_send"),
                              node_recv=add("node_recv"),
                              deepspeed_capacity=max((p.deepspeed_capacity for p in parts), default=0))


@dataclass(frozen=True)
class StepTraffic:
    """Bytes and rows this rank sends in one forward of one MoE layer."""

    inter_node_rows: int = 0  # token rows sent to other nodes: dispatch + combine return
    inter_node_bytes: int = 0  # those rows plus route metadata and gate weights, plus the replica bytes below
    intra_node_rows: int = 0  # rows sent to other ranks of this node: dispatch + combine return
    intra_node_bytes: int = 0
    deepspeed_inter_node_bytes_padded: int = 0  # DeepSpeed's E x C buffers to ranks on other nodes
    tokens: int = 0
    expert_rows: int = 0  # rows this rank's experts computed (its share of the layer's work)
    replica_inter_node_bytes: int = 0  # replica weights and their gradients to other nodes (module docstring)
    replica_intra_node_bytes: int = 0  # ... to other ranks of this node

    @classmethod
    def measure(cls, counts: ExchangeCounts, *, row_bytes: int, topology, experts_per_rank: int,
                rail_peer_node: Sequence[int], rail_self: int | None, node_self: int,
                replica_rows: tuple[Sequence[int], Sequence[int]] = ((), ()),
                expert_bytes: int = 0) -> "StepTraffic":
        """`rail_peer_node[p]`: the node of rail peer p; `rail_self`: this rank among the rail peers (None when
        it is not one: the hierarchical rail holds one rank per node); `node_self`: this rank in the node stage.
        `replica_rows`: the experts whose weights this rank sends to each EP rank in forward, and those it
        receives from each (and returns gradients for in backward); `expert_bytes`: one expert's parameters."""
        inter_rows = inter_meta = intra_rows = intra_meta = 0
        for p, node in enumerate(rail_peer_node):
            rows, meta = counts.rail_send[p] + counts.rail_recv[p], counts.route_send[p]
            if node != topology.node:
                inter_rows, inter_meta = inter_rows + rows, inter_meta + meta
            elif p != rail_self:
                intra_rows, intra_meta = intra_rows + rows, intra_meta + meta
        node_send, node_recv = counts.node_send, counts.node_recv
        node_out = sum(node_send) - node_send[node_self]
        intra_rows += node_out + sum(node_recv) - node_recv[node_self]
        remote_ranks = topology.world_size - topology.ranks_per_node
        ds_padded_rows = 2 * remote_ranks * experts_per_rank * counts.deepspeed_capacity
        replica_inter = replica_intra = 0
        for p, (sent, received) in enumerate(zip(*replica_rows)):
            half = (sent + received) * expert_bytes // 2  # weights out in forward, gradients out in backward
            if p // topology.ranks_per_node != topology.node:
                replica_inter += half
            elif p != topology.rank:
                replica_intra += half
        return cls(
            inter_node_rows=inter_rows,
            inter_node_bytes=inter_rows * row_bytes + inter_meta * META_BYTES_PER_ROUTE + replica_inter,
            intra_node_rows=intra_rows,
            intra_node_bytes=(intra_rows * row_bytes + intra_meta * META_BYTES_PER_ROUTE + node_out * SLOT_ID_BYTES
                              + replica_intra),
            deepspeed_inter_node_bytes_padded=ds_padded_rows * row_bytes,
            tokens=counts.tokens,
            expert_rows=sum(node_recv),
            replica_inter_node_bytes=replica_inter,
            replica_intra_node_bytes=replica_intra,
        )


@dataclass
class TrafficCounters:
    """Running totals over forward passes of one layer on one rank.

    `deepspeed_inter_node_bytes_dropless` (one row per (token, expert) on another node, both ways) is
    accumulated on the device by `add_deepspeed_routes` and read in `totals`."""

    steps: int = 0
    inter_node_rows: int = 0
    inter_node_bytes: int = 0
    intra_node_rows: int = 0
    intra_node_bytes: int = 0
    deepspeed_inter_node_bytes_padded: int = 0
    tokens: int = 0
    expert_rows: int = 0
    replica_inter_node_bytes: int = 0
    replica_intra_node_bytes: int = 0
    last: StepTraffic | None = None
    _row_bytes: int = 0
    _deepspeed_remote_routes: torch.Tensor | None = field(default=None, repr=False)

    def add(self, step: StepTraffic) -> None:
        self.steps += 1
        for item in fields(step):
            setattr(self, item.name, getattr(self, item.name) + getattr(step, item.name))
        self.last = step

    def add_deepspeed_routes(self, remote_routes: torch.Tensor, row_bytes: int) -> None:
        """Routes DeepSpeed would have sent to another node this forward (`[1]` int64, on the device)."""
        self._row_bytes = row_bytes
        acc = self._deepspeed_remote_routes
        self._deepspeed_remote_routes = remote_routes.detach() if acc is None else acc + remote_routes.detach()

    def totals(self) -> dict[str, int]:
        out = {item.name: getattr(self, item.name) for item in fields(self)
               if item.name != "last" and not item.name.startswith("_")}
        routes = self._deepspeed_remote_routes
        out["deepspeed_inter_node_bytes_dropless"] = (
            0 if routes is None else 2 * int(routes.sum().item()) * self._row_bytes)  # NOTE: host sync, on read
        return out


def sum_totals(counters: Sequence[TrafficCounters]) -> dict[str, int]:
    """Totals summed over layers; `steps` is the largest per-layer count (forward passes of the model)."""
    total: dict[str, int] = {}
    for counter in counters:
        for key, value in counter.totals().items():
            total[key] = max(total.get(key, 0), value) if key == "steps" else total.get(key, 0) + value
    if not total:
        total = TrafficCounters().totals()
    return total
