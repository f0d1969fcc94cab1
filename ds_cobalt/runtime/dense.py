"""The `dense` schedule: DeepSpeed's own exchange (padded E x C buffers, one even all-to-all each way), on any
owner layout.

Legend: T tokens, K routes per token, D hidden size, E experts, W EP ranks, L = E / W owner slots per rank,
C capacity (rows per expert and source rank).

Each route (token t, expert e) takes row `location` of expert e's C rows; the buffer of this rank is
`[W, L, C, D]`, block (r, s) holding the rows for the expert in owner slot s of rank r. One all-to-all sends
block r to rank r, each owner slot's expert runs on its `[W * C, D]` rows, one all-to-all returns them, and
each token sums its routes' weighted outputs (fp32). Where the layout is DeepSpeed's contiguous one, this is
DeepSpeed's `MOELayer` exchange; elsewhere only the block order differs. Replica slots stay unused, so there
is no weight fetch. Collectives: 2 forward, 2 backward (DeepSpeed's count); no count exchange, so every rank
must use the same C, as DeepSpeed's layer needs: the gate's dropless capacity is reduced over the group
(one all-reduce, as DeepSpeed's gate does), a fixed capacity (`drop_tokens=True`) is checked against the one
agreed when the schedule was chosen.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..kernels import accumulate_dtype, gather_rows
from .comm import all_to_all_rows
from .placement import LayerPlacement, rank_within_key
from .sync_free import count_keys
from .topology import EPGroups
from .traffic import ExchangeCounts

ExpertFn = Callable[[torch.Tensor], torch.Tensor]


def expert_locations(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each route's row among its expert's rows on this rank (routes in token order, DeepSpeed's top-k order)
    and the largest count of one expert (`[1]` int64, on the device): for routers that give no locations."""
    T, K = topk_ids_TK.shape
    valid = topk_ids_TK.reshape(-1) >= 0
    key = torch.where(valid, topk_ids_TK.reshape(-1).long(), torch.full_like(valid, num_experts, dtype=torch.long))
    location = rank_within_key(key)
    counts = count_keys(key, num_experts)
    return location.reshape(T, K), counts.max().reshape(1) if num_experts else counts.new_zeros(1)


def dense_moe(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, locations_TK: torch.Tensor, weights_TK: torch.Tensor,
              placement: LayerPlacement, groups: EPGroups, slot_fns: Sequence[ExpertFn | None], capacity: int,
              backend: str = "torch") -> tuple[torch.Tensor, ExchangeCounts]:
    """`[T, D]` combined outputs and the exchange's split sizes (module docstring). `locations_TK`: each route's
    row among its expert's C rows on this rank (DeepSpeed's gate returns them), unused where `topk_ids_TK` is -1."""
    T, D = x_TD.shape
    W, L, C = placement.world_size, placement.owner_slots_per_rank, int(capacity)
    device = x_TD.device
    valid_TK = topk_ids_TK >= 0
    block_E = placement.owner_block_E.to(device)  # owner rank * L + owner slot of each expert
    cell_TK = block_E[topk_ids_TK.clamp(min=0).long()] * C + locations_TK.long()
    empty = W * L * C  # the spare cell of dropped routes
    cell_TK = torch.where(valid_TK & (locations_TK < C), cell_TK, torch.full_like(cell_TK, empty))
    token_TK = torch.arange(T, device=device).unsqueeze(1).expand_as(cell_TK)
    source_X = torch.full((empty + 1,), T, dtype=torch.int64, device=device)
    source_X.scatter_(0, cell_TK.reshape(-1), token_TK.reshape(-1))  # one route per cell; the spare one is dropped
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, D)])
    send_XD = gather_rows(x_pad, source_X[:empty], backend=backend)
    split = [L * C] * W
    recv_XD = all_to_all_rows(send_XD, split, split, groups.ep_group)
    # [W, L, C, D] -> one [W * C, D] block per owner slot, as DeepSpeed's experts take them: `unbind` views
    # (backward: one stack of the slot gradients, not a zero-filled buffer per slot), one copy per slot, and
    # the outputs stacked straight into [W, L, C, D]
    per_slot = recv_XD.view(W, L, C, D).unbind(1)
    outs = []
    for s in range(L):
        fn = slot_fns[s]
        assert fn is not None, f"owner slot {s} has no expert"
        out = fn(per_slot[s].reshape(W * C, D))
        outs.append((out[0] if isinstance(out, tuple) else out).view(W, C, D))
    out_XD = torch.stack(outs, dim=1).reshape(W * L * C, D)
    back_XD = all_to_all_rows(out_XD, split, split, groups.ep_group)
    kept_TK = cell_TK < empty
    # dropped routes read any row (row 0) with weight 0, as DeepSpeed's combine weighs every buffer row
    weight_TK = torch.where(kept_TK, weights_TK.float(), torch.zeros_like(weights_TK, dtype=torch.float32))
    if empty == 0:  # C = 0 on every rank: nothing was sent
        back_XD = back_XD.new_zeros(1, D)
    rows_RD = gather_rows(back_XD, torch.where(kept_TK, cell_TK, 0).reshape(-1), backend=backend)
    # every token has exactly K rows, in token order: a weighted sum over K (fp32, or wider) costs less than a
    # scatter-add and its backward (measured on CPU: 0.35 against 0.46 ms forward + backward, T=1024, K=2)
    acc = accumulate_dtype(rows_RD.dtype)
    K = topk_ids_TK.shape[1]
    out_TD = (rows_RD.to(acc).reshape(T, K, D) * weight_TK.to(acc).unsqueeze(2)).sum(1).to(rows_RD.dtype)
    sent = (L * C,) * W
    counts = ExchangeCounts(tokens=T, rail_send=sent, rail_recv=sent, route_send=(0,) * W, node_send=(0,),
                            node_recv=(W * L * C,), deepspeed_capacity=C)
    return out_TD, counts
