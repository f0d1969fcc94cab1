"""Exact traffic counters of one forward pass (dispatch + combine), and their running totals.

Counted from the split sizes the dispatcher already has on the host, so they cost no extra sync.
Backward sends the same volumes again in reverse; DeepSpeed's does too, so ratios hold for a step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Sequence


@dataclass(frozen=True)
class StepTraffic:
    """Bytes and rows this rank sends in one forward of one MoE layer."""

    inter_node_rows: int = 0  # (token, node) rows sent on the rail: dispatch + combine return
    inter_node_bytes: int = 0  # those rows plus route metadata and gate weights
    intra_node_rows: int = 0  # rows sent to other ranks of this node: dispatch + combine return
    intra_node_bytes: int = 0
    deepspeed_inter_node_bytes_padded: int = 0  # DeepSpeed's E x C buffers to ranks on other nodes
    deepspeed_inter_node_bytes_dropless: int = 0  # one row per (token, expert) on another node, both ways
    tokens: int = 0
    expert_rows: int = 0  # rows this rank's experts computed (its share of the layer's work)

    @classmethod
    def measure(cls, *, row_bytes: int, topology, experts_per_rank: int, pairs_sent: int, pairs_received: int,
                routes_sent: int, meta_bytes_per_route: int, node_send: Sequence[int], node_recv: Sequence[int],
                slot_id_bytes: int, deepspeed_capacity: int, deepspeed_remote_routes: int, tokens: int) -> "StepTraffic":
        me = topology.local_rank
        inter_rows = pairs_sent + pairs_received  # dispatch out + combine return of received pairs
        intra_rows = (sum(node_send) - node_send[me]) + (sum(node_recv) - node_recv[me])
        remote_ranks = topology.world_size - topology.ranks_per_node
        ds_padded_rows = 2 * remote_ranks * experts_per_rank * deepspeed_capacity
        return cls(
            inter_node_rows=inter_rows,
            inter_node_bytes=inter_rows * row_bytes + routes_sent * meta_bytes_per_route,
            intra_node_rows=intra_rows,
            intra_node_bytes=intra_rows * row_bytes + (sum(node_send) - node_send[me]) * slot_id_bytes,
            deepspeed_inter_node_bytes_padded=ds_padded_rows * row_bytes,
            deepspeed_inter_node_bytes_dropless=2 * deepspeed_remote_routes * row_bytes,
            tokens=tokens,
            expert_rows=sum(node_recv),
        )


@dataclass
class TrafficCounters:
    """Running totals over forward passes of one layer on one rank."""

    steps: int = 0
    inter_node_rows: int = 0
    inter_node_bytes: int = 0
    intra_node_rows: int = 0
    intra_node_bytes: int = 0
    deepspeed_inter_node_bytes_padded: int = 0
    deepspeed_inter_node_bytes_dropless: int = 0
    tokens: int = 0
    expert_rows: int = 0
    last: StepTraffic | None = None

    def add(self, step: StepTraffic) -> None:
        self.steps += 1
        for item in fields(step):
            setattr(self, item.name, getattr(self, item.name) + getattr(step, item.name))
        self.last = step

    def totals(self) -> dict[str, int]:
        out = asdict(self)
        out.pop("last")
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
