"""Count the collectives and host syncs a block of code makes (tests and benchmarks).

Fixed cost per call dominates small messages, so these counts are what a regression changes first.

- `count_collectives()` wraps `torch.distributed`'s collective and point-to-point calls.
- `count_host_syncs()` wraps the tensor operations that make the host wait for the device: reading values
  (`tolist`, `item`, `int()`, `float()`, `bool()`), data-dependent shapes (`nonzero`, boolean-mask indexing,
  `masked_select`, `unique`, `repeat_interleave` with tensor repeats and no `output_size`, `bincount`), and host data
  copied to a device as it is made (`torch.tensor` / `torch.as_tensor` of non-tensor data with a `device`: a
  pageable copy). On CPU nothing waits, but the same calls are the syncs of the CUDA path; there
  `torch.cuda.set_sync_debug_mode` confirms them (`benchmarks/gpu_moe_check.py`).

Each yields a `collections.Counter` keyed by the caller's `file:line` (outside torch), so a failing count says
where the extra call is. Not thread-safe: patches module attributes for the duration of the block.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

COLLECTIVES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter_tensor", "isend", "irecv", "send", "recv", "barrier")


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


@contextmanager
def _patched(owner: Any, names: tuple[str, ...], counts: Counter, when: Callable[..., bool] | None = None):
    originals = {name: getattr(owner, name) for name in names if hasattr(owner, name)}

    def wrap(original):
        def counted(*args, **kwargs):
            if when is None or when(*args, **kwargs):
                counts[_caller()] += 1
            return original(*args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(owner, name, original)


@contextmanager
def count_collectives() -> Iterator[Counter]:
    """Collective and point-to-point calls of `torch.distributed` made inside the block."""
    counts: Counter = Counter()
    with _patched(dist, COLLECTIVES, counts):
        yield counts


def _is_bool_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _bool_index(self, index, *rest) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(_is_bool_tensor(i) for i in items)


def _tensor_repeats(input, repeats=None, dim=None, *, output_size=None) -> bool:
    return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and output_size is None


def _host_data_to_device(data=None, *args, device=None, **kwargs) -> bool:
    return device is not None and not isinstance(data, torch.Tensor)


@contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Host syncs made inside the block (see the module docstring for what counts)."""
    counts: Counter = Counter()
    reads = ("tolist", "item", "__int__", "__float__", "__bool__", "nonzero", "masked_select", "unique")
    with _patched(torch.Tensor, reads, counts), \
            _patched(torch.Tensor, ("__getitem__",), counts, _bool_index), \
            _patched(torch, ("nonzero", "masked_select", "unique", "bincount"), counts), \
            _patched(torch, ("tensor", "as_tensor"), counts, _host_data_to_device), \
            _patched(torch, ("repeat_interleave",), counts, _tensor_repeats), \
            _patched(torch.Tensor, ("repeat_interleave",), counts, _tensor_repeats):
        yield counts
