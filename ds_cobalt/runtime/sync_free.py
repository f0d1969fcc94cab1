"""Two torch idioms that make a CUDA host wait, and their sync-free forms for the per-forward paths.

- `torch.bincount` reads the largest key on the host to size its output, even with `minlength`: `count_keys`
  scatter-adds into a fixed size instead.
- `torch.tensor(host_values, device="cuda")` copies from pageable memory and waits for the copy: `device_ints`
  copies through pinned memory, asynchronously (torch's pinned allocator keeps the buffer until the copy is done).

`runtime.call_counts.count_host_syncs` counts both idioms on any device, so a CPU test fails where a CUDA run
would wait (seen on an H200: 6 host syncs per hierarchical forward where the CPU count said 1).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def count_keys(key: torch.Tensor, n: int) -> torch.Tensor:
    """`torch.bincount(key, minlength=n + 1)[:n]` for int64 keys in `[0, n]` (key n is ignored), without a host
    sync."""
    return torch.zeros(n + 1, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))[:n]


def device_ints(values: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
                device: torch.device | str) -> torch.Tensor:
    """int64 tensor of host `values` (nested sequences or an array) on `device`, without a host sync."""
    host = torch.as_tensor(np.ascontiguousarray(values, dtype=np.int64))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_int_arrays(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """`device_ints` of several arrays in one copy; each comes back in its own shape."""
    flat = device_ints(np.concatenate([np.ravel(a) for a in arrays]) if arrays else [], device)
    return [part.reshape(np.shape(a)) for part, a in zip(flat.split([np.size(a) for a in arrays]), arrays)]


def int_column(value: torch.Tensor | int, rows: int, device: torch.device) -> torch.Tensor:
    """`[rows, 1]` int64 copies of a tensor's or a Python int's value on `device` (an int is filled in there, with
    no host-to-device copy)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, torch.int64).reshape(1, 1).expand(rows, 1)
    return torch.full((rows, 1), int(value), dtype=torch.int64, device=device)
