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

from ..planner.layout import owner_rank_of
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
    return plan_replicas_of(placement.slots_WS, placement.num_experts, rank)


def plan_replicas_of(slots_WS: np.ndarray, num_experts: int, rank: int) -> ReplicaPlan:
    """The replica plan of layout `slots_WS` (`[W, S]`, owner slots first) for `rank`."""
    W, S = slots_WS.shape
    per_rank = num_experts // W
    owner = owner_rank_of(slots_WS, num_experts)
    owner_slot_E = np.empty(num_experts, dtype=np.int64)
    owner_slot_E[slots_WS[:, :per_rank]] = np.arange(per_rank)[None, :]
    spare = slots_WS[:, per_rank:]
    sent_WX = (spare >= 0) & (owner[np.maximum(spare, 0)] == rank)  # my experts in each rank's spare slots
    send_slot = owner_slot_E[spare[sent_WX]].tolist()  # row-major: by destination rank, then slot
    send_splits = sent_WX.sum(1).tolist()
    mine = np.nonzero(spare[rank] >= 0)[0] + per_rank
    src = owner[slots_WS[rank, mine]]
    order = np.lexsort((mine, src))  # rows arrive grouped by source rank; order the slots the same way
    recv_splits = np.bincount(src, minlength=W).tolist()
    return ReplicaPlan(tuple(send_slot), tuple(send_splits), tuple(mine[order].tolist()), tuple(recv_splits))


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
