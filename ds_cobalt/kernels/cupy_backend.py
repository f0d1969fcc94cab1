"""CuPy launchers of the kernels in the repository's `cuda/` directory (shipped as `ds_cobalt.cuda`).

Imported lazily by `ds_cobalt.kernels.ops` (importing this module imports cupy). Each launcher checks
shapes and dtypes, allocates its outputs with torch (the caching allocator), computes the grid and
launches on torch's current CUDA stream. Tensors reach the kernels as raw device addresses (8-byte numpy scalars,
passed by value like any pointer argument; 16-bit floats are read as raw bits, since CuPy has no bfloat16): a
DLPack view per tensor cost ~20 us of host time per argument, 0.14 ms per small launch on an H200.
Semantics are those of `ref.py`.

Legend: T tokens, K routes, N nodes, D hidden, P pairs, R routes, O output rows.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np
import torch

from .sources import cuda_source

__all__ = ["dedup_pairs", "gather_rows", "weighted_scatter_add", "set_chunk_flag", "stream_wait_value32"]

_ROW_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_INDEX_DTYPES = {torch.int32: "i32", torch.int64: "i64"}
_WARP_BLOCK = 256  # 8 warps; the row kernels use one warp per row


# ------------------------------------------------------------------------------------------ loading
@functools.lru_cache(maxsize=None)
def _module(name: str) -> cupy.RawModule:
    return cupy.RawModule(code=cuda_source(name), options=("--std=c++14",))


@functools.lru_cache(maxsize=None)
def _kernel(name: str, function: str, device_index: int) -> cupy.RawKernel:
    with cupy.cuda.Device(device_index):
        return _module(name).get_function(function)  # compiled for this device's arch on first use


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=64)
def _stream(handle: int, device_index: int) -> cupy.cuda.ExternalStream:
    return cupy.cuda.ExternalStream(handle, device_index)


def _launch(tensor: torch.Tensor, name: str, function: str, grid: int, block: int, args: tuple) -> None:
    """Launch `function` of `cuda/<name>` on the current torch stream of `tensor`'s device."""
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    kernel = _kernel(name, function, index)
    stream = _stream(torch.cuda.current_stream(index).cuda_stream, index)
    if cupy.cuda.runtime.getDevice() == index:
        with stream:
            kernel((grid,), (block,), args)
    else:
        with cupy.cuda.Device(index), stream:
            kernel((grid,), (block,), args)


def _cp(tensor: torch.Tensor) -> np.uint64:
    """The device address of a contiguous CUDA tensor, as a kernel argument."""
    assert tensor.is_contiguous(), "kernel arguments must be contiguous"
    return np.uint64(tensor.data_ptr())


def _warp_grid(rows: int, device_index: int) -> int:
    return max(1, min((rows + _WARP_BLOCK // 32 - 1) // (_WARP_BLOCK // 32), _num_sms(device_index) * 32))


def _flat_grid(items: int, block: int, device_index: int) -> int:
    return max(1, min((items + block - 1) // block, _num_sms(device_index) * 16))


def _check_cuda(*tensors: torch.Tensor) -> int:
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"the cupy backend needs all tensors on one CUDA device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    return device.index if device.index is not None else torch.cuda.current_device()


def _check_rows(rows: torch.Tensor, name: str) -> None:
    if rows.dim() != 2 or rows.dtype not in _ROW_DTYPES:
        raise ValueError(f"{name} must be a 2-D float32/bfloat16/float16 tensor, got {rows.dtype} "
                         f"shape {tuple(rows.shape)}")


def _check_index(index: torch.Tensor, name: str, length: int | None = None) -> None:
    if index.dim() != 1 or index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {index.dtype} shape {tuple(index.shape)}")
    if length is not None and index.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {index.shape[0]}")


# ---------------------------------------------------------------------------------------- dedup_pairs
def dedup_pairs(dest_node_TK: torch.Tensor, src_node: int, num_nodes: int,
                padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `ref.dedup_pairs`. Kernels: cuda/dedup_pairs.cu (mark, scan, compact)."""
    dev = _check_cuda(dest_node_TK)
    if dest_node_TK.dim() != 2 or dest_node_TK.dtype not in _INDEX_DTYPES:
        raise ValueError(f"dest_node_TK must be a 2-D int32/int64 tensor, got {dest_node_TK.dtype} "
                         f"shape {tuple(dest_node_TK.shape)}")
    N = int(num_nodes)
    if N < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    T, K = dest_node_TK.shape
    if N * T >= 2**31:
        raise ValueError(f"num_nodes * T = {N * T} exceeds the int32 positions of dedup_scan")
    dest = dest_node_TK.contiguous()
    device = dest.device
    rail_send_N = torch.zeros(N, dtype=torch.int64, device=device)
    pair_index_TK = torch.empty((T, K), dtype=torch.int64, device=device)
    bound = T * min(K, max(N - 1, 0))
    if T * K == 0:
        return torch.empty(bound if padded else 0, dtype=torch.int64, device=device), rail_send_N, pair_index_TK
    suffix = _INDEX_DTYPES[dest.dtype]
    flags_NT = torch.zeros(N * T, dtype=torch.uint8, device=device)
    pos_NT = torch.empty(N * T, dtype=torch.int32, device=device)
    scalars = (np.int64(T), np.int32(K), np.int64(src_node), np.int64(N))
    _launch(dest, "dedup_pairs.cu", f"dedup_mark_{suffix}", _flat_grid(T, 256, dev), 256,
            (_cp(dest), *scalars, _cp(flags_NT)))
    _launch(dest, "dedup_pairs.cu", "dedup_scan", N, 256, (_cp(flags_NT), np.int64(T), _cp(pos_NT), _cp(rail_send_N)))
    # the output size depends on the data: the bound when padded, else the count (NOTE: host sync)
    P = bound if padded else int(rail_send_N.sum().item())
    pair_token_P = torch.empty(P, dtype=torch.int64, device=device)
    _launch(dest, "dedup_pairs.cu", f"dedup_compact_{suffix}", _flat_grid(T * K, 256, dev), 256,
            (_cp(dest), *scalars, _cp(pos_NT), _cp(rail_send_N), _cp(pair_token_P), _cp(pair_index_TK)))
    return pair_token_P, rail_send_N, pair_index_TK


# ---------------------------------------------------------------------------------------- gather_rows
def _gather_rows(x_TD: torch.Tensor, index_P: torch.Tensor) -> torch.Tensor:
    dev = _check_cuda(x_TD, index_P)
    _check_rows(x_TD, "x_TD")
    _check_index(index_P, "index_P")
    x = x_TD.contiguous()
    index = index_P.contiguous()
    P, D = index.shape[0], x.shape[1]
    out_PD = torch.empty((P, D), dtype=x.dtype, device=x.device)
    row_bytes = D * x.element_size()
    if P == 0 or row_bytes == 0:
        return out_PD
    # widest vector dividing the row size and both base addresses (torch allocations are 512-byte aligned,
    # but x may be a view with an offset)
    vec = next(v for v in (16, 8, 4, 2) if row_bytes % v == 0 and x.data_ptr() % v == 0
               and out_PD.data_ptr() % v == 0)
    view_dtype = {16: torch.int32, 8: torch.int32, 4: torch.int32, 2: torch.int16}[vec]
    _launch(x, "gather_rows.cu", f"gather_rows_v{vec}_{_INDEX_DTYPES[index.dtype]}", _warp_grid(P, dev), _WARP_BLOCK,
            (_cp(x.view(view_dtype)), _cp(index), _cp(out_PD.view(view_dtype)), np.int64(x.shape[0]), np.int64(P),
             np.int64(row_bytes // vec)))
    return out_PD


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, index_P: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index_P)
        ctx.rows_in = x_TD.shape[0]
        return _gather_rows(x_TD, index_P)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_PD: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        (index_P,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None
        return _scatter_add(grad_PD.contiguous(), index_P, None, ctx.rows_in, None), None


def gather_rows(x_TD: torch.Tensor, index_P: torch.Tensor) -> torch.Tensor:
    """See `ref.gather_rows`. Kernel: cuda/gather_rows.cu; backward: cuda/weighted_scatter_add.cu."""
    return _GatherRows.apply(x_TD, index_P)


# ------------------------------------------------------------------------------- weighted_scatter_add
def _weight_f32(weight_R: torch.Tensor | None, R: int, device: torch.device) -> tuple[torch.Tensor, int]:
    if weight_R is None:
        return torch.ones(1, dtype=torch.float32, device=device), 0
    if tuple(weight_R.shape) != (R,) or not weight_R.dtype.is_floating_point:
        raise ValueError(f"weight_R must be a float [R] = [{R}] tensor, got {weight_R.dtype} "
                         f"shape {tuple(weight_R.shape)}")
    return weight_R.detach().to(torch.float32).contiguous(), 1


def _scatter_add(rows_RD: torch.Tensor, index_R: torch.Tensor, weight_R: torch.Tensor | None, num_out: int,
                 base_OD: torch.Tensor | None) -> torch.Tensor:
    tensors = [t for t in (rows_RD, index_R, weight_R, base_OD) if t is not None]
    dev = _check_cuda(*tensors)
    _check_rows(rows_RD, "rows_RD")
    R, D = rows_RD.shape
    _check_index(index_R, "index_R", R)
    O = int(num_out)
    if base_OD is not None and (tuple(base_OD.shape) != (O, D) or base_OD.dtype != rows_RD.dtype):
        raise ValueError(f"base_OD must be [{O}, {D}] {rows_RD.dtype}, got {tuple(base_OD.shape)} {base_OD.dtype}")
    rows = rows_RD.detach().contiguous()
    index = index_R.contiguous()
    if base_OD is None:
        acc_OD = torch.zeros((O, D), dtype=torch.float32, device=rows.device)
    else:
        acc_OD = base_OD.detach().to(torch.float32, copy=True).contiguous()
    if weight_R is not None and (tuple(weight_R.shape) != (R,) or not weight_R.dtype.is_floating_point):
        raise ValueError(f"weight_R must be a float [R] = [{R}] tensor, got {weight_R.dtype} "
                         f"shape {tuple(weight_R.shape)}")
    if R > 0 and D > 0:
        weight, has_weight = _weight_f32(weight_R, R, rows.device)
        vec = "vec4_" if D % 4 == 0 else ""
        name = f"weighted_scatter_add_{vec}{_ROW_DTYPES[rows.dtype]}_{_INDEX_DTYPES[index.dtype]}"
        _launch(rows, "weighted_scatter_add.cu", name, _warp_grid(R, dev), _WARP_BLOCK,
                (_cp(rows), _cp(index), _cp(weight), np.int32(has_weight), _cp(acc_OD), np.int64(R), np.int64(D),
                 np.int64(O)))
    return acc_OD if rows.dtype == torch.float32 else acc_OD.to(rows.dtype)


def _scatter_add_backward(grad_OD: torch.Tensor, rows_RD: torch.Tensor, index_R: torch.Tensor,
                          weight_R: torch.Tensor | None, want_rows: bool,
                          want_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dev = _check_cuda(grad_OD, rows_RD)
    R, D = rows_RD.shape
    grad = grad_OD.to(rows_RD.dtype).contiguous()
    grad_rows = torch.empty_like(rows_RD) if want_rows else None
    grad_w = torch.empty(R, dtype=torch.float32, device=rows_RD.device) if want_weight else None
    if R > 0:
        dummy = torch.empty(1, dtype=rows_RD.dtype, device=rows_RD.device)
        dummy_f = torch.empty(1, dtype=torch.float32, device=rows_RD.device)
        weight, has_weight = _weight_f32(weight_R, R, rows_RD.device)
        name = f"weighted_scatter_add_backward_{_ROW_DTYPES[rows_RD.dtype]}_{_INDEX_DTYPES[index_R.dtype]}"
        _launch(rows_RD, "weighted_scatter_add.cu", name, _warp_grid(R, dev), _WARP_BLOCK,
                (_cp(grad), _cp(rows_RD), _cp(index_R), _cp(weight), np.int32(has_weight),
                 _cp(grad_rows if want_rows else dummy), np.int32(want_rows),
                 _cp(grad_w if want_weight else dummy_f), np.int32(want_weight),
                 np.int64(R), np.int64(D), np.int64(grad.shape[0])))
    elif want_weight:
        grad_w.zero_()
    if grad_w is not None and weight_R is not None:
        grad_w = grad_w.to(weight_R.dtype)
    return grad_rows, grad_w


class _WeightedScatterAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_RD: torch.Tensor, index_R: torch.Tensor, weight_R: torch.Tensor | None,  # type: ignore[override]
                num_out: int, base_OD: torch.Tensor | None) -> torch.Tensor:
        out = _scatter_add(rows_RD, index_R, weight_R, num_out, base_OD)
        ctx.save_for_backward(rows_RD, index_R, weight_R)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_OD: torch.Tensor):  # type: ignore[override]
        rows_RD, index_R, weight_R = ctx.saved_tensors
        want_rows, _, want_weight, _, want_base = ctx.needs_input_grad
        grad_rows = grad_w = None
        if want_rows or want_weight:
            grad_rows, grad_w = _scatter_add_backward(grad_OD, rows_RD.detach().contiguous(), index_R.contiguous(),
                                                      weight_R, want_rows, bool(want_weight))
        grad_base = grad_OD.to(rows_RD.dtype) if want_base else None
        return grad_rows, None, grad_w, None, grad_base


def weighted_scatter_add(rows_RD: torch.Tensor, index_R: torch.Tensor, weight_R: torch.Tensor | None,
                         num_out: int, *, base_OD: torch.Tensor | None = None) -> torch.Tensor:
    """See `ref.weighted_scatter_add`. Kernels: cuda/weighted_scatter_add.cu (forward and fused backward)."""
    return _WeightedScatterAdd.apply(rows_RD, index_R, weight_R, int(num_out), base_OD)


# ------------------------------------------------------------------------------------------ chunk flags
def set_chunk_flag(flags_C: torch.Tensor, chunk: int, value: int) -> None:
    """Publish `flags_C[chunk] = value` on the current stream (cuda/chunk_flags.cu)."""
    _check_cuda(flags_C)
    if flags_C.dtype != torch.int32 or flags_C.dim() != 1 or not flags_C.is_contiguous():
        raise ValueError(f"flags_C must be a contiguous 1-D int32 tensor, got {flags_C.dtype} {tuple(flags_C.shape)}")
    if not 0 <= chunk < flags_C.shape[0]:
        raise ValueError(f"chunk {chunk} out of range [0, {flags_C.shape[0]})")
    _launch(flags_C, "chunk_flags.cu", "set_chunk_flag", 1, 32, (_cp(flags_C), np.int64(chunk), np.int32(value)))


def stream_wait_value32():
    """CuPy's binding of cuStreamWaitValue32, or None (CuPy 14.2 does not expose it)."""
    from cupy_backends.cuda.api import driver

    return getattr(driver, "streamWaitValue32", None)
