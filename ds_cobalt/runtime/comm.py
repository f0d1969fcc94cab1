"""Every collective of the dispatcher lives here: count exchange and variable-size all-to-all.

All functions take the process group explicitly; `group=None` means a group of one rank (the call is
a local copy), never the default world group.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def exchange_counts(send_counts_PC: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`[P, C]` int64 counts for each of the P peers -> the `[P, C]` counts each peer sends to us."""
    if group is None:
        return send_counts_PC.clone()
    recv = torch.empty_like(send_counts_PC)
    dist.all_to_all_single(recv, send_counts_PC.contiguous(), group=group)
    return recv


def all_to_all_rows(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Variable-size all-to-all of the rows of `rows` (dim 0); differentiable.

    `send_splits[p]` rows go to peer p, `recv_splits[p]` rows arrive from it. Backward sends the
    gradient rows back along the reversed splits.
    """
    if group is None:
        return rows
    return _AllToAllRows.apply(rows, tuple(send_splits), tuple(recv_splits), group)


def _all_to_all(rows: torch.Tensor, send_splits: tuple[int, ...], recv_splits: tuple[int, ...],
                group: dist.ProcessGroup) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows, list(recv_splits), list(send_splits), group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):  # type: ignore[override]
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        return _all_to_all(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad_out, recv_splits, send_splits, ctx.group), None, None, None
