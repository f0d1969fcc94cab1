"""Redundant slots: fetch each replica's weights from its owner, differentiably.

Forward sends the owner's flattened parameters to every rank holding a replica; backward returns the
replica's gradient to the owner, where autograd adds it to the owner's parameter gradient before any
DeepSpeed gradient hook fires. So the optimizer sees each logical expert once, and gradient norms
and clipping count it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .comm import all_to_all_rows
from .placement import LayerPlacement
from .topology import EPGroups


@dataclass(frozen=True)
class ReplicaPlan:
    """Who sends which owner slot to whom. Orders match on both sides: by peer rank, then slot."""

    send_owner_slot: tuple[int, ...]  # owner slot of each row this rank sends
    send_splits: tuple[int, ...]  # rows to each EP rank
    recv_slot: tuple[int, ...]  # redundant slot filled by each row received
    recv_splits: tuple[int, ...]  # rows from each EP rank

    @property
    def empty(self) -> bool:
        return not self.send_owner_slot and not self.recv_slot


def plan_replicas(placement: LayerPlacement, rank: int) -> ReplicaPlan:
    slots = placement.slots_WS
    per_rank = placement.owner_slots_per_rank
    owner = placement.owner_rank_E()
    owner_slot_E = np.empty(placement.num_experts, dtype=np.int64)
    owner_slot_E[slots[:, :per_rank]] = np.arange(per_rank)[None, :]
    W = placement.world_size
    send_slot: list[int] = []
    send_splits: list[int] = []
    recv_slot: list[int] = []
    recv_splits: list[int] = [0] * W
    for dst in range(W):
        mine = [int(owner_slot_E[e]) for e in slots[dst, per_rank:] if e >= 0 and owner[e] == rank]
        send_slot += mine
        send_splits.append(len(mine))
    for s in range(per_rank, placement.slots_per_rank):
        e = slots[rank, s]
        if e >= 0:
            recv_slot.append(s)
            recv_splits[int(owner[e])] += 1
    # Rows arrive grouped by source rank; order the slots the same way.
    recv_slot.sort(key=lambda s: (int(owner[slots[rank, s]]), s))
    return ReplicaPlan(tuple(send_slot), tuple(send_splits), tuple(recv_slot), tuple(recv_splits))


def fetch_replicas(owner_params: Sequence[Sequence[torch.Tensor]], plan: ReplicaPlan,
                   groups: EPGroups) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor]:
    """`owner_params[i]` are the parameters of owner slot i.

    Returns redundant slot -> parameter tensors, and `anchor`: an exact 0-d zero that the caller adds
    to the layer output so that the all-to-all's backward runs on every rank, also on ranks that
    hold, send or use no replica this step (otherwise their peers would wait in backward).
    """
    shapes = [p.shape for p in owner_params[0]]
    numels = [p.numel() for p in owner_params[0]]
    slots_to_send = plan.send_owner_slot or (0,)
    send = torch.stack([torch.cat([p.reshape(-1) for p in owner_params[i]]) for i in slots_to_send])
    send = send if plan.send_owner_slot else send[:0]
    recv = all_to_all_rows(send, plan.send_splits, plan.recv_splits, groups.ep_group)
    fetched: dict[int, list[torch.Tensor]] = {}
    for row, slot in zip(recv, plan.recv_slot):
        fetched[slot] = [piece.view(shape) for piece, shape in zip(row.split(numels), shapes)]
    return fetched, recv[:0].sum()
