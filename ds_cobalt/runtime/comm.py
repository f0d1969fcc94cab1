"""Every collective of the dispatcher lives here: count exchange and variable-size all-to-all.

All functions take the process group explicitly; `group=None` means a group of one rank (the call is
a local copy), never the default world group.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .sync_free import int_column


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _alone(group: dist.ProcessGroup | None) -> bool:
    """A group of one rank (or none): every exchange is a local copy, made without a collective call."""
    return group_size(group) == 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a collective's tensors must live for `group`'s backend: CPU under gloo or MPI, else (NCCL and the
    other accelerator backends, which move no host memory) the current CUDA device."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce_host(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`all_reduce` of a host tensor on any backend (through the device where the backend needs one); returns
    the reduced values on the host (`tensor` itself under gloo). Collective on `group` (None: the world)."""
    device = collective_device(group)
    work = tensor.to(device)
    dist.all_reduce(work, op=op, group=group)
    return work.cpu()


def slowest_rank(seconds: Sequence[float], group: dist.ProcessGroup | None) -> torch.Tensor:
    """`[N]` float64 host tensor: `seconds` as the slowest rank of `group` measured them (one all-reduce, MAX;
    none without a group)."""
    out = torch.tensor(list(seconds), dtype=torch.float64)
    return out if group is None else all_reduce_host(out, dist.ReduceOp.MAX, group)


def exchange_counts(send_counts_PC: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`[P, C]` int64 counts for each of the P peers -> the `[P, C]` counts each peer sends to us."""
    if _alone(group):
        return send_counts_PC.clone()
    recv = torch.empty_like(send_counts_PC)
    dist.all_to_all_single(recv, send_counts_PC.contiguous(), group=group)
    return recv


def group_capacity(capacity: torch.Tensor | int, is_local: bool, group: dist.ProcessGroup | None,
                   device: torch.device) -> int:
    """A DeepSpeed gate's capacity as a host int: the largest over `group` when `capacity` is this rank's
    dropless value (`is_local`; the all-reduce DeepSpeed's gate would have made), else as it is."""
    reduce = is_local and not _alone(group)
    if not reduce and not isinstance(capacity, torch.Tensor):
        return int(capacity)
    value = int_column(capacity, 1, device).reshape(1).clone()
    if reduce:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())  # NOTE: host sync


# (seconds list, synchronise) while `timed_exchanges` is active in this context; None otherwise
_EXCHANGE_TIMES: ContextVar[tuple[list[float], Callable[[], None]] | None] = ContextVar("exchange_times", default=None)


@contextmanager
def timed_exchanges(synchronize: Callable[[], None]) -> Iterator[list[float]]:
    """Within: the seconds of every forward row exchange (`all_to_all_rows`, `all_to_all_row_pair`), the device
    synchronised before and after each, in call order, in the list yielded (DeepSpeed's `wall_clock_breakdown`).
    Outside it the exchanges time nothing."""
    times: list[float] = []
    token = _EXCHANGE_TIMES.set((times, synchronize))
    try:
        yield times
    finally:
        _EXCHANGE_TIMES.reset(token)


def _timed(exchange: Callable, *args):
    sink = _EXCHANGE_TIMES.get()
    if sink is None:
        return exchange(*args)
    times, synchronize = sink
    synchronize()
    start = time.perf_counter()
    out = exchange(*args)
    synchronize()
    times.append(time.perf_counter() - start)
    return out


def all_to_all_rows(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Variable-size all-to-all of the rows of `rows` (dim 0); differentiable.

    `send_splits[p]` rows go to peer p, `recv_splits[p]` rows arrive from it. Backward sends the
    gradient rows back along the reversed splits.
    """
    if _alone(group):
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
        return _timed(_all_to_all, rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad_out, recv_splits, send_splits, ctx.group), None, None, None


Splits = tuple[tuple[int, ...], tuple[int, ...]]


def all_to_all_row_pair(a: torch.Tensor, b: torch.Tensor, send_splits: Splits, recv_splits: Splits,
                        group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two variable-size all-to-alls (rows of `a` and rows of `b`, any dtypes) in one message; differentiable.

    `send_splits = (a_splits, b_splits)`: peer p gets `a_splits[p]` rows of `a` then `b_splits[p]` rows of `b`,
    as bytes; `recv_splits` likewise."""
    if _alone(group):
        return a, b
    return _AllToAllRowPair.apply(a, b, tuple(map(tuple, send_splits)), tuple(map(tuple, recv_splits)), group)


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _pack(a: torch.Tensor, b: torch.Tensor, splits: Splits) -> tuple[torch.Tensor, list[int]]:
    a8 = a.contiguous().view(torch.uint8).reshape(a.shape[0], _row_bytes(a))
    b8 = b.contiguous().view(torch.uint8).reshape(b.shape[0], _row_bytes(b))
    pieces = [part.reshape(-1) for pa, pb in zip(a8.split(list(splits[0])), b8.split(list(splits[1])))
              for part in (pa, pb)]
    return torch.cat(pieces), [x.numel() + y.numel() for x, y in zip(pieces[0::2], pieces[1::2])]


def _unpack(buf: torch.Tensor, splits: Splits, like_a: torch.Tensor,
            like_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ra, rb = _row_bytes(like_a), _row_bytes(like_b)
    parts = buf.split([na * ra + nb * rb for na, nb in zip(*splits)])
    a8 = torch.cat([p[: na * ra] for p, na in zip(parts, splits[0])])
    b8 = torch.cat([p[na * ra:] for p, na in zip(parts, splits[0])])
    return (a8.view(like_a.dtype).reshape(-1, *like_a.shape[1:]), b8.view(like_b.dtype).reshape(-1, *like_b.shape[1:]))


def _pair_exchange(a: torch.Tensor, b: torch.Tensor, send: Splits, recv: Splits,
                   group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    buf, send_bytes = _pack(a, b, send)
    recv_bytes = [na * _row_bytes(a) + nb * _row_bytes(b) for na, nb in zip(*recv)]
    out = buf.new_empty(sum(recv_bytes))
    dist.all_to_all_single(out, buf, recv_bytes, send_bytes, group=group)
    return _unpack(out, recv, a, b)


class _AllToAllRowPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, send_splits, recv_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        ctx.like = (a.new_empty((0, *a.shape[1:])), b.new_empty((0, *b.shape[1:])))
        return _timed(_pair_exchange, a, b, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_a, grad_b):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        like_a, like_b = ctx.like
        grad_a = like_a.new_zeros((sum(recv_splits[0]), *like_a.shape[1:])) if grad_a is None else grad_a
        grad_b = like_b.new_zeros((sum(recv_splits[1]), *like_b.shape[1:])) if grad_b is None else grad_b
        ga, gb = _pair_exchange(grad_a, grad_b, recv_splits, send_splits, ctx.group)
        return ga, gb, None, None, None
