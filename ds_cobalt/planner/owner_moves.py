"""Owner moves of one layer: which owner slots each EP rank sends and fills when owners are permuted.

Legend: E experts, W EP ranks, S slots per rank, P = E / W owner slots per rank.
Pure and deterministic: every rank computes the same plan from the same two layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import owner_rank_of

__all__ = ["OwnerMoves", "plan_owner_moves", "owner_slot_of", "align_owner_slots"]


@dataclass(frozen=True)
class OwnerMoves:
    """One layer's owner permutation seen from one rank. Rows of one (source, destination) pair are
    ordered by new slot on both sides."""

    send_slot: tuple[int, ...]  # old owner slot of each row this rank sends
    send_splits: tuple[int, ...]  # rows to each EP rank (this rank included for in-rank slot changes)
    recv_slot: tuple[int, ...]  # new owner slot filled by each row received
    recv_splits: tuple[int, ...]  # rows from each EP rank
    moved: tuple[tuple[int, int, int], ...]  # (expert, old rank, new rank) of every expert that moves

    @property
    def empty(self) -> bool:
        return not self.moved


def owner_slot_of(slots_WS: np.ndarray, per_rank: int) -> np.ndarray:
    """`[E]` owner slot (on its owner rank) of every expert of a `[W, S]` layout."""
    owners = np.asarray(slots_WS)[:, :per_rank]
    slot_E = np.empty(owners.size, dtype=np.int64)
    slot_E[owners.reshape(-1)] = np.tile(np.arange(per_rank), owners.shape[0])
    return slot_E


def plan_owner_moves(old_WS: np.ndarray, new_WS: np.ndarray, per_rank: int, rank: int) -> OwnerMoves:
    """What `rank` sends and receives to go from owners `old_WS` to `new_WS` (`[W, S]`, P owner slots)."""
    W = int(np.asarray(old_WS).shape[0])
    E = W * per_rank
    old_rank, old_slot = owner_rank_of(old_WS, E), owner_slot_of(old_WS, per_rank)
    new_rank, new_slot = owner_rank_of(new_WS, E), owner_slot_of(new_WS, per_rank)
    moving = [e for e in range(E) if (old_rank[e], old_slot[e]) != (new_rank[e], new_slot[e])]
    send_slot: list[int] = []
    send_splits: list[int] = []
    recv_slot: list[int] = []
    recv_splits: list[int] = []
    for peer in range(W):
        out = sorted((e for e in moving if old_rank[e] == rank and new_rank[e] == peer), key=lambda e: new_slot[e])
        send_slot += [int(old_slot[e]) for e in out]
        send_splits.append(len(out))
        inc = sorted((e for e in moving if new_rank[e] == rank and old_rank[e] == peer), key=lambda e: new_slot[e])
        recv_slot += [int(new_slot[e]) for e in inc]
        recv_splits.append(len(inc))
    moved = tuple((int(e), int(old_rank[e]), int(new_rank[e])) for e in moving)
    return OwnerMoves(tuple(send_slot), tuple(send_splits), tuple(recv_slot), tuple(recv_splits), moved)


def align_owner_slots(current_WS: np.ndarray, new_WS: np.ndarray, per_rank: int) -> np.ndarray:
    """`new_WS` with each rank's owners reordered so experts that stay on a rank keep their slot."""
    out = np.array(new_WS, dtype=np.int64, copy=True)
    for r in range(out.shape[0]):
        wanted = [int(e) for e in new_WS[r, :per_rank]]
        row = [-1] * per_rank
        for i, e in enumerate(current_WS[r, :per_rank]):
            if int(e) in wanted:
                row[i] = int(e)
        rest = iter(e for e in wanted if e not in row)
        out[r, :per_rank] = [e if e >= 0 else next(rest) for e in row]
    return out
