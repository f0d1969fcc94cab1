"""The kernel interface: one function per op, each with an explicit `backend` choice.

`backend="torch"` runs `ref.py` (the spec, any device). `backend="cupy"` runs the CUDA kernels of the
repository's `cuda/` directory through CuPy (CUDA tensors only). `backend="auto"` runs torch off CUDA or without
CuPy; on CUDA with CuPy each op takes the backend measured faster at its size (`auto_backend`). Both backends
agree up to floating-point summation order (the scatter-adds use atomics on the GPU).

Legend: T tokens, K routes, N nodes, D hidden, P (token, remote node) pairs, R routes, O output rows.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import torch

from . import ref

if TYPE_CHECKING:
    from .flags import ChunkReadyFlags

Backend = Literal["auto", "torch", "cupy"]
_BACKENDS = ("auto", "torch", "cupy")

__all__ = ["Backend", "chunk_ready_flags", "dedup_pairs", "gather_rows", "weighted_scatter_add", "resolve_backend",
           "auto_backend", "cupy_install_hint"]


def cupy_install_hint() -> str:
    """How to install CuPy for this machine (the wheel must match the CUDA major version)."""
    cuda = torch.version.cuda
    major = cuda.split(".")[0] if cuda else None
    pick = f" (this torch is built for CUDA {cuda}: `pip install cupy-cuda{major}x`)" if major in ("12", "13") else ""
    return ("install the CuPy wheel matching your CUDA major version, as `nvidia-smi` reports it: "
            f"`pip install cupy-cuda12x` for CUDA 12.x or `pip install cupy-cuda13x` for CUDA 13.x{pick}; "
            "or pass backend='torch'")


@functools.cache
def _cupy_import_error() -> str | None:
    """Why CuPy does not import (None: it does); tried once per process."""
    try:
        importlib.import_module("cupy")
    except Exception as exc:  # noqa: BLE001 - a broken install (e.g. wrong CUDA wheel) also means "no cupy"
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_backend(backend: str, *tensors: torch.Tensor | None, device: torch.device | None = None) -> str:
    """`"torch"` or `"cupy"` for these tensors (or this device); raises with the fix for impossible choices."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    devices = {t.device for t in tensors if t is not None}
    if device is not None:
        devices.add(torch.device(device))
    on_cuda = bool(devices) and all(d.type == "cuda" for d in devices)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "cupy" if on_cuda and _cupy_import_error() is None else "torch"
    if not on_cuda:
        raise ValueError(f"backend='cupy' needs CUDA tensors, got tensors on {sorted(map(str, devices))}; "
                         "move them to the GPU (`.cuda()`) or pass backend='torch' (or 'auto')")
    error = _cupy_import_error()
    if error is not None:
        raise ImportError(f"backend='cupy' needs CuPy, which does not import ({error}); {cupy_install_hint()}")
    return "cupy"


# Measured on two H200s, forward + backward, bf16 and fp32 (`benchmarks/gpu_checks.py`, docs/kernels.md): the dedup
# kernels beat torch's ~10 ops 2.2-2.9x at every size; a CuPy launch costs 50-70 us more host time than a torch op,
# which the row kernels repay from some size on (rows x hidden): the weighted scatter-add from 16.8M (1.2-1.9x
# there, 0.9-1.2x at 8.4M, 2.7-4x at 537M), the gather from 67M (its scatter-add backward wins: 1.1-1.6x there,
# 1.5-2x at 537M; its forward alone is never faster than torch's `index_select`).
CUPY_MIN_ELEMENTS = {"weighted_scatter_add": 1 << 24, "gather_rows": 1 << 26}


def auto_backend(op: str, elements: int) -> str:
    """What `backend="auto"` runs for `op` on CUDA with CuPy: `"cupy"` or `"torch"`. `elements`: rows x hidden of
    the row kernels (`gather_rows`, `weighted_scatter_add`), unused for `dedup_pairs`."""
    if op == "dedup_pairs":
        return "cupy"
    if op in CUPY_MIN_ELEMENTS:
        return "cupy" if elements >= CUPY_MIN_ELEMENTS[op] else "torch"
    raise ValueError(f"unknown op {op!r}")


def _impl(backend: str, *tensors: torch.Tensor | None, op: str, elements: int = 0) -> ModuleType:
    choice = resolve_backend(backend, *tensors)
    if choice == "cupy" and backend == "auto":
        choice = auto_backend(op, elements)
    if choice == "torch":
        return ref
    from . import cupy_backend

    return cupy_backend


def dedup_pairs(dest_node_TK: torch.Tensor, src_node: int, num_nodes: int, *, padded: bool = False,
                backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, remote node) pairs of one source rank: `(pair_token_P, rail_send_N, pair_index_TK)`.

    `dest_node_TK`: `[T, K]` int32/int64, -1 = dropped. `pair_token_P`: `[P]` int64, node-major then token
    order. `rail_send_N`: `[N]` int64 pairs per node. `pair_index_TK`: `[T, K]` int64 pair of each route,
    -1 = local or dropped. Syncs with the host (P depends on the data), unless `padded` (then `pair_token_P`
    holds `T * min(K, N - 1)` entries, the P pairs first). See `ref.dedup_pairs`.
    """
    return _impl(backend, dest_node_TK, op="dedup_pairs").dedup_pairs(dest_node_TK, src_node, num_nodes, padded)


def gather_rows(x_TD: torch.Tensor, index_P: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """`[P, D]` = `x_TD[index_P]` (int32/int64 indices in `[0, T)`); differentiable in `x_TD`."""
    return _impl(backend, x_TD, index_P, op="gather_rows",
                 elements=index_P.numel() * (x_TD.shape[1] if x_TD.dim() == 2 else 1)).gather_rows(x_TD, index_P)


def weighted_scatter_add(rows_RD: torch.Tensor, index_R: torch.Tensor, weight_R: torch.Tensor | None,
                         num_out: int, *, base_OD: torch.Tensor | None = None,
                         backend: Backend = "auto") -> torch.Tensor:
    """`[num_out, D]` in the rows' dtype: `(base_OD +) sum_r rows_RD[r] * weight_R[r]` into row `index_R[r]`,
    accumulated in float32. `weight_R=None` means unit weights. Differentiable in rows, weights and base.
    """
    return _impl(backend, rows_RD, index_R, weight_R, base_OD, op="weighted_scatter_add",
                 elements=rows_RD.numel()).weighted_scatter_add(
        rows_RD, index_R, weight_R, num_out, base_OD=base_OD)


def chunk_ready_flags(num_chunks: int, device: torch.device | str, *,
                      backend: Backend = "auto") -> "ChunkReadyFlags":
    """Per-chunk ready flags on `device` for the overlap scheduler; see `ds_cobalt.kernels.flags`."""
    from .flags import ChunkReadyFlags

    # "auto": torch's `fill_` (38-52 us of host time per mark + wait on an H200, the CuPy kernel 41-74 us)
    return ChunkReadyFlags(num_chunks, device, "torch" if backend == "auto"
                           else resolve_backend(backend, device=torch.device(device)))
