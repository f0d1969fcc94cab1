"""Stage 2 every step: each node refills its spare slots from this forward's loads.

Legend: E experts, N nodes, G ranks per node, W = N * G ranks, S slots per rank, C copies on this node.

Stage 1 (the planner, at a re-plan) decides the owners and the cross-node traffic copies (spare slots holding an
expert owned on another node). Every other spare slot is *refillable*: in each forward of the hierarchical
schedule, after the count exchange, the node gives it a replica of one of its own experts, chosen from the routes
that arrive at the node in this forward (`planner.stage2.refill_node`), and its weights come from the owner
inside the node. Sources choose only the node of each route (`placement.assign_nodes`, unchanged by the refill:
the node holds its own experts anyway); the relay picks the copy.

Copy choice: the routes of expert e at this node are numbered by (relay, source node, source order) and cut
into consecutive ranges, one per copy in (local rank, slot) order, sized by the refill's water-filled shares.
Every rank of the node receives every source's per-expert counts in the count exchange, so each derives the
same refill, its own split sizes and, as a relay, the copy of each of its routes, without another collective.
The host needs only the `[G, E]` counts per relay (`fill_step` runs after the layer's one host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planner.layout import owner_rank_of
from ..planner.stage2 import max_over_mean, refill_node, refillable_slots
from .sync_free import device_int_arrays


@dataclass(frozen=True)
class NodeSpares:
    """This rank's node, as stage 2 sees it for one layout."""

    node_slots_GS: np.ndarray  # [G, S] the node's slots, refillable ones -1
    free_GS: np.ndarray  # [G, S] bool: refillable
    eligible_E: np.ndarray  # [E] bool: owned on this node (weights fetched inside it)
    base_WS: np.ndarray  # [W, S] the whole layout with every node's refillable slots -1
    static_node_GS: np.ndarray  # [G, S] the node's slots as the layout has them (the interval's replicas)
    node: int
    held_NX: torch.Tensor  # [N, X] experts each node holds (owners and traffic copies), padded with E


def node_spares(slots_WS: np.ndarray, ranks_per_node: int, num_experts: int, rank: int,
                device: torch.device | str = "cpu") -> NodeSpares | None:
    """Stage 2's view of layout `slots_WS` for `rank`; None when no node has a refillable slot (the same answer
    on every rank, so every rank runs the same exchange)."""
    G = ranks_per_node
    free_WS = refillable_slots(slots_WS, G, num_experts)
    if not free_WS.any():
        return None
    owner_node_E = owner_rank_of(slots_WS, num_experts) // G
    base_WS = np.where(free_WS, -1, slots_WS)
    node = rank // G
    rows = slice(node * G, (node + 1) * G)
    # routes reach a node only for the experts it holds, which a refill does not change: the count exchange
    # carries just those
    held = [np.unique(block[block >= 0]) for block in base_WS.reshape(-1, G * base_WS.shape[1])]
    held_NX = np.full((len(held), max(h.size for h in held)), num_experts, dtype=np.int64)
    for n, h in enumerate(held):
        held_NX[n, : h.size] = h
    return NodeSpares(base_WS[rows], free_WS[rows], owner_node_E == node, base_WS, slots_WS[rows].copy(), node,
                      torch.as_tensor(held_NX, device=device))


@dataclass(frozen=True)
class StepFill:
    """One forward's refill of this node and the split sizes it implies for this rank."""

    slots_WS: np.ndarray  # [W, S] the layout of this forward (this node refilled, others' refillable slots -1)
    send_GS: list[list[int]]  # rows this relay sends to each local rank, per slot
    recv_GS: list[list[int]]  # rows this expert rank receives from each relay, per slot
    load_G: np.ndarray  # [G] rows each GPU of the node serves this forward
    static_load_G: np.ndarray  # [G] the same with the layout's own spare slots (no per-step refill)
    copy_local_C: torch.Tensor  # [C] local rank of each copy, by (expert, local rank, slot)
    copy_slot_C: torch.Tensor  # [C] its slot
    copy_start_E: torch.Tensor  # [E] first copy of each expert
    copy_end_EM: torch.Tensor  # [E, M] end of each copy's range of the expert's routes (padded with the largest)


def _copies(node_GS: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies of a node's slots ordered by (expert, local rank, slot): their expert, local rank and slot."""
    g, s = np.nonzero(node_GS >= 0)
    e = node_GS[g, s]
    order = np.lexsort((s, g, e))
    return e[order], g[order], s[order]


def _even_shares(e_C: np.ndarray, load_E: np.ndarray) -> np.ndarray:
    """Each copy's rows when its expert's rows are split evenly over the copies (the interval's replicas)."""
    copies_E = np.bincount(e_C, minlength=load_E.size)
    i_C = np.arange(e_C.size) - (np.cumsum(copies_E) - copies_E)[e_C]
    j_C, L_C = copies_E[e_C], load_E[e_C]
    ceil_div = lambda a, b: -((-a) // b)  # noqa: E731
    return ceil_div((i_C + 1) * L_C, j_C) - ceil_div(i_C * L_C, j_C)


def fill_step(spares: NodeSpares, relay_counts_GE: np.ndarray, local_rank: int,
              device: torch.device) -> StepFill:
    """Refill this node from `relay_counts_GE[g, e]` (routes of expert e reaching the node through relay g)."""
    G, S = spares.node_slots_GS.shape
    E = relay_counts_GE.shape[1]
    load_E = relay_counts_GE.sum(0)
    node_GS, share_GS = refill_node(spares.node_slots_GS, spares.free_GS, load_E, spares.eligible_E)
    e_C, g_C, s_C = _copies(node_GS)
    share_C = share_GS[g_C, s_C]
    copies_E = np.bincount(e_C, minlength=E)
    start_E = np.cumsum(copies_E) - copies_E
    hi_C = np.cumsum(share_C) - (np.cumsum(share_C) - share_C)[start_E[e_C]]  # running sum within the expert
    lo_C = hi_C - share_C
    held = np.zeros(load_E.size, dtype=bool)
    held[e_C] = True
    if load_E[~held].any():
        raise RuntimeError("ds_cobalt stage 2: routes arrived for an expert this node does not hold")
    # relay g's routes of expert e are the numbers [pre_GE[g, e], pre_GE[g, e] + counts)
    pre_GE = np.cumsum(relay_counts_GE, 0) - relay_counts_GE
    rlo_GC, rhi_GC = pre_GE[:, e_C], pre_GE[:, e_C] + relay_counts_GE[:, e_C]
    inter_GC = np.maximum(np.minimum(rhi_GC, hi_C) - np.maximum(rlo_GC, lo_C), 0)
    send_GS = np.zeros((G, S), dtype=np.int64)
    np.add.at(send_GS, (g_C, s_C), inter_GC[local_rank])
    recv_GS = np.zeros((G, S), dtype=np.int64)
    mine = g_C == local_rank
    recv_GS[:, s_C[mine]] = inter_GC[:, mine]
    slots_WS = spares.base_WS.copy()
    slots_WS[spares.node * G: (spares.node + 1) * G] = node_GS
    se_C, sg_C, _ = _copies(spares.static_node_GS)
    end_EM = np.full((E, max(1, int(copies_E.max(initial=0)))), np.iinfo(np.int64).max, dtype=np.int64)
    end_EM[e_C, np.arange(e_C.size) - start_E[e_C]] = hi_C
    return StepFill(slots_WS, send_GS.tolist(), recv_GS.tolist(), np.bincount(g_C, weights=share_C, minlength=G),
                    np.bincount(sg_C, weights=_even_shares(se_C, load_E), minlength=G),
                    *device_int_arrays((g_C, s_C, start_E, end_EM), device))


def copy_of_routes(fill: StepFill, counts_WE: torch.Tensor, ranks_per_node: int, src_R: torch.Tensor,
                   expert_R: torch.Tensor, order_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (local rank, slot) serving each route a relay holds: from source `src_R`, of expert `expert_R`,
    `order_R`-th of that source's routes of that expert here. `counts_WE[s, e]`: routes source s sends this node."""
    G = ranks_per_node
    N = counts_WE.shape[0] // G
    counts_NGE = counts_WE.reshape(N, G, -1)
    relay_GE = counts_NGE.sum(0)
    pre_GE = torch.cumsum(relay_GE, 0) - relay_GE  # by relay first
    within_NGE = torch.cumsum(counts_NGE, 0) - counts_NGE  # then by source node
    n_R, g_R = src_R // G, src_R % G
    number_R = pre_GE[g_R, expert_R] + within_NGE[n_R, g_R, expert_R] + order_R
    copy_R = fill.copy_start_E[expert_R] + (fill.copy_end_EM[expert_R] <= number_R[:, None]).sum(1)
    return fill.copy_local_C[copy_R], fill.copy_slot_C[copy_R]




@dataclass
class BalanceCounters:
    """Per forward with stage 2 every step: max/mean of the rows each GPU of this rank's node serves, refilled
    and with the layout's own spare slots (tokens split evenly over the copies in both); running sums, so a long
    run keeps a constant size."""

    forwards: int = 0
    refilled_sum: float = 0.0
    interval_sum: float = 0.0
    last_slots_WS: np.ndarray | None = None  # the last refilled layout (this node's rows refilled)

    def add(self, fill: StepFill) -> None:
        self.forwards += 1
        self.refilled_sum += max_over_mean(fill.load_G)
        self.interval_sum += max_over_mean(fill.static_load_G)
        self.last_slots_WS = fill.slots_WS

    def summary(self) -> dict[str, float | int]:
        """Forwards counted and the mean of both ratios over them."""
        if not self.forwards:
            return {"forwards": 0}
        return {"forwards": self.forwards, "gpu_max_over_mean_stage2": self.refilled_sum / self.forwards,
                "gpu_max_over_mean_interval": self.interval_sum / self.forwards}
