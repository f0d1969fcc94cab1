"""Torch reference of the dispatch/combine kernels: this file is the spec the CuPy kernels must match.

Legend: T tokens, K routes per token, N nodes, D hidden size, P (token, remote node) pairs, R routes
(rows to scatter), O output rows.

Every function here is exactly the torch code `ds_cobalt.runtime.dispatch` runs today (same ops, same
order), so swapping a call site to these functions changes nothing, bit for bit. They run on any device,
are differentiable through ordinary autograd, and accept float64 (for gradcheck).
"""

from __future__ import annotations

import torch

__all__ = ["dedup_pairs", "gather_rows", "weighted_scatter_add", "accumulate_dtype"]


def dedup_pairs(dest_node_TK: torch.Tensor, src_node: int, num_nodes: int,
                padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deduplicate the (token, remote node) pairs of one source rank.

    `dest_node_TK`: `[T, K]` int32/int64 destination node of each route, -1 = dropped route; values must
    lie in `[-1, num_nodes)`. Routes to `src_node` are local (no pair).
    Returns:
      - `pair_token_P`: `[P]` int64, the token of each pair, node-major then ascending token order;
      - `rail_send_N`: `[N]` int64, pairs per destination node (so node n's pairs are the slice
        `[start_n, start_n + rail_send_N[n])` with `start_n = cumsum(rail_send_N) - rail_send_N`);
      - `pair_index_TK`: `[T, K]` int64, for each remote route the index in `[0, P)` of its pair
        (routes of one token to the same node share it), -1 for local or dropped routes.
    The number of pairs P depends on the data: on CUDA this syncs with the host (as `nonzero` does), unless
    `padded`: then `pair_token_P` has the bound `T * min(K, N - 1)` entries, the P pairs first, the rest
    unspecified, and nothing waits (the caller cuts it at `rail_send_N.sum()` once that is on the host).
    """
    if dest_node_TK.dim() != 2:
        raise ValueError(f"dest_node_TK must be [T, K], got shape {tuple(dest_node_TK.shape)}")
    T, K = dest_node_TK.shape
    N = int(num_nodes)
    device = dest_node_TK.device
    remote_TK = (dest_node_TK >= 0) & (dest_node_TK != src_node)
    # Non-remote routes mark a spare row N, so the marks need no data-dependent indexing.
    node_TK = torch.where(remote_TK, dest_node_TK.long(), torch.full_like(dest_node_TK, N, dtype=torch.long))
    cell_TK = node_TK * T + torch.arange(T, device=device).unsqueeze(1)
    pair_NT = torch.zeros((N + 1) * T, dtype=torch.bool, device=device)
    pair_NT.scatter_(0, cell_TK.reshape(-1), True)
    pair_NT = pair_NT.reshape(N + 1, T)[:N]
    if padded:
        bound = T * min(K, max(N - 1, 0))
        pair_token_P = torch.argsort((~pair_NT).reshape(-1).to(torch.uint8), stable=True)[:bound] % max(T, 1)
    else:
        _, pair_token_P = pair_NT.nonzero(as_tuple=True)  # NOTE: host sync (P depends on the data)
    rail_send_N = pair_NT.sum(1)
    pair_pos = torch.cumsum(pair_NT.reshape(-1), 0) - 1
    pair_index_TK = torch.where(remote_TK, pair_pos[cell_TK.clamp(max=N * T - 1)], torch.full_like(cell_TK, -1))
    return pair_token_P, rail_send_N, pair_index_TK


def gather_rows(x_TD: torch.Tensor, index_P: torch.Tensor) -> torch.Tensor:
    """`[P, D]` rows `x_TD[index_P]` (int32/int64 indices in `[0, T)`), same dtype as `x_TD`.

    Backward: the gradient rows are scatter-added back (`index_add`) into a `[T, D]` zero tensor.
    """
    _check_rows_index(x_TD, index_P, "x_TD", "index_P")
    return torch.index_select(x_TD, 0, index_P)  # backward: index_add (advanced indexing's sorts for duplicates)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype of `weighted_scatter_add`: float32, or the rows' dtype if wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def weighted_scatter_add(rows_RD: torch.Tensor, index_R: torch.Tensor, weight_R: torch.Tensor | None,
                         num_out: int, *, base_OD: torch.Tensor | None = None) -> torch.Tensor:
    """`[num_out, D]`: `out[index_R[r]] += rows_RD[r] * weight_R[r]`, accumulated in float32, cast to rows' dtype.

    `index_R`: `[R]` int32/int64 in `[0, num_out)`. `weight_R`: `[R]` float (any float dtype) or None for 1.
    `base_OD`: optional `[num_out, D]` tensor of the rows' dtype added into the accumulator first (one
    rounding for "base + sum", instead of an index_add in bf16).
    Differentiable in `rows_RD`, `weight_R` and `base_OD`:
    grad_rows[r] = grad_out[index[r]] * weight[r], grad_weight[r] = dot(grad_out[index[r]], rows[r]).
    """
    _check_rows_index(rows_RD, index_R, "rows_RD", "index_R")
    if index_R.shape[0] != rows_RD.shape[0]:
        raise ValueError(f"index_R must be [R] = [{rows_RD.shape[0]}], got shape {tuple(index_R.shape)}")
    if weight_R is not None and tuple(weight_R.shape) != (rows_RD.shape[0],):
        raise ValueError(f"weight_R must be [R] = [{rows_RD.shape[0]}], got shape {tuple(weight_R.shape)}")
    acc_dtype = accumulate_dtype(rows_RD.dtype)
    contrib_RD = rows_RD.to(acc_dtype)
    if weight_R is not None:
        contrib_RD = contrib_RD * weight_R.to(acc_dtype).unsqueeze(1)
    if base_OD is None:
        acc_OD = contrib_RD.new_zeros((int(num_out), rows_RD.shape[1]))
    else:
        if tuple(base_OD.shape) != (int(num_out), rows_RD.shape[1]) or base_OD.dtype != rows_RD.dtype:
            raise ValueError(f"base_OD must be [{int(num_out)}, {rows_RD.shape[1]}] {rows_RD.dtype}, got "
                             f"{tuple(base_OD.shape)} {base_OD.dtype}")
        acc_OD = base_OD.to(acc_dtype)
    return acc_OD.index_add(0, index_R, contrib_RD).to(rows_RD.dtype)


def _check_rows_index(rows: torch.Tensor, index: torch.Tensor, rows_name: str, index_name: str) -> None:
    if rows.dim() != 2:
        raise ValueError(f"{rows_name} must be 2-D [rows, D], got shape {tuple(rows.shape)}")
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{index_name} must be a 1-D int32/int64 tensor, got {index.dtype} "
                         f"shape {tuple(index.shape)}")
