"""Grouped expert compute over the slots of one rank.

Legend: Q rows received, D hidden size, S slots on this rank.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

ExpertFn = Callable[[torch.Tensor], torch.Tensor]


def run_experts(rows_QD: torch.Tensor, slot_Q: torch.Tensor, slot_counts: Sequence[int],
                slot_fns: Sequence[ExpertFn | None]) -> torch.Tensor:
    """Apply slot s's expert to the rows tagged s; returns `[Q, D]` outputs in input row order.

    Every held slot runs, even on zero rows, so each expert parameter (and each fetched replica)
    stays in the autograd graph on every rank and the collectives in backward line up.
    """
    order = torch.argsort(slot_Q, stable=True)
    chunks = rows_QD[order].split(list(slot_counts))
    outputs = []
    for slot, (chunk, fn) in enumerate(zip(chunks, slot_fns)):
        if fn is None:
            assert chunk.shape[0] == 0, f"rows routed to empty slot {slot}"
            outputs.append(chunk)
            continue
        out = fn(chunk)
        outputs.append(out[0] if isinstance(out, tuple) else out)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(outputs)[inverse]
