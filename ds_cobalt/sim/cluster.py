"""Cluster simulator: predicted time of the MoE layers per training step (forward + backward).

Legend: L layers, T tokens, K top-k, E experts, N nodes, G GPUs per node, W = N * G ranks, S slots.

Inputs: a routing trace (cut into steps of `step_tokens` tokens), a layout, a `Hardware` and a `ModelShape`
(`sim/hardware.py`). Per layer and step the simulator counts rows per GPU (sent across nodes, sent inside
the node, computed) for each implementation, then turns them into time with an alpha-beta model; all
GPUs wait for the slowest one in every collective (each stage time is a max over GPUs / nodes).

Implementations (the equations are in docs/simulator.md):
- `deepspeed`: DeepSpeed's padded all-to-all, `E x C` rows per GPU with C from the capacity factor (or the
  largest expert count when `capacity_factor is None`, DeepSpeed's `drop_tokens=False`); contiguous layout.
- `deepspeed-dropless`: an ideal dropless all-to-all with uneven splits, one row per (token, expert).
- `cobalt`: ds_cobalt's runtime on the given layout (the hierarchical schedule): `assign_tasks` picks replicas,
  one row per (token, remote node) on the rail with its routes in the same message, intra-node forwarding per
  route, replicas balance compute; `cobalt-overlap` additionally overlaps communication with expert compute.
- `cobalt-direct`: the direct schedule, one row per (token, destination GPU) in one exchange each way;
  `cobalt-dense`: the dense schedule, DeepSpeed's padded buffers on the layout (no replicas).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..planner.assign import assign_tasks
from ..planner.layout import Layout, owner_rank_of, owners_first
from ..planner.trace import Trace
from .hardware import Hardware, ModelShape

__all__ = ["LayerRows", "ReplicaFetch", "replica_fetch", "deepspeed_rows", "dropless_rows", "padded_rows",
           "scaled_rows", "cobalt_rows", "direct_rows", "layer_times", "predict_step_times", "VARIANTS",
           "predict_synthetic", "format_prediction", "step_of_tokens"]

VARIANTS = ("deepspeed", "deepspeed-dropless", "cobalt", "cobalt-overlap", "cobalt-direct", "cobalt-dense")

_ROUTE_BYTES = 16  # a remote route on the rail: row in the pair block, local rank, slot, gate weight (4 x fp32)


@dataclass(frozen=True)
class LayerRows:
    """Rows per GPU of one layer in one step (one forward pass, dispatch direction; combine mirrors it).

    `inter_out_W`/`inter_in_W`: rows leaving / entering GPU w across nodes (data rows);
    `intra_out_W`/`intra_in_W`: rows to / from peers in the node (data rows);
    `compute_W`: (token, expert) rows computed on GPU w (padding included for padded all-to-all);
    `routes_out_W`/`routes_in_W`: remote routes (for ds_cobalt's per-route metadata; 0 for DeepSpeed).
    """

    inter_out_W: np.ndarray
    inter_in_W: np.ndarray
    intra_out_W: np.ndarray
    intra_in_W: np.ndarray
    compute_W: np.ndarray
    routes_out_W: np.ndarray
    routes_in_W: np.ndarray


@dataclass(frozen=True)
class ReplicaFetch:
    """Bytes per GPU of one layer's replica weights in one forward (the owners send them to the spare slots holding
    their experts; backward returns the gradients the other way): `inter_*` across nodes (traffic copies),
    `intra_*` inside the node."""

    inter_out_W: np.ndarray
    inter_in_W: np.ndarray
    intra_out_W: np.ndarray
    intra_in_W: np.ndarray

    @property
    def empty(self) -> bool:
        return not (self.inter_in_W.any() or self.intra_in_W.any())


def replica_fetch(slots_WS: np.ndarray, num_experts: int, G: int, expert_bytes: float) -> ReplicaFetch:
    """The `ReplicaFetch` of a layout `[W, S]` (owners in the first E / W slots) for experts of `expert_bytes`."""
    slots_WS = np.asarray(slots_WS)
    W, P = slots_WS.shape[0], num_experts // slots_WS.shape[0]
    owner_E = owner_rank_of(slots_WS, num_experts)
    w, s = np.nonzero(slots_WS[:, P:] >= 0)
    owner = owner_E[slots_WS[w, P + s]]
    moved = owner != w
    w, owner = w[moved], owner[moved]
    cross = owner // G != w // G
    senders_and_holders = (owner[cross], w[cross], owner[~cross], w[~cross])
    return ReplicaFetch(*(np.bincount(r, minlength=W) * float(expert_bytes) for r in senders_and_holders))


def scaled_rows(rows: LayerRows, factor: float) -> LayerRows:
    return LayerRows(*(np.asarray(a, dtype=np.float64) * factor for a in (
        rows.inter_out_W, rows.inter_in_W, rows.intra_out_W, rows.intra_in_W, rows.compute_W, rows.routes_out_W,
        rows.routes_in_W)))


def _pair_rows(src_X: np.ndarray, dst_X: np.ndarray, W: int, G: int) -> tuple[np.ndarray, ...]:
    """(inter_out, inter_in, intra_out, intra_in) of messages src -> dst (self-sends are free)."""
    cross = src_X // G != dst_X // G
    intra = ~cross & (src_X != dst_X)
    return (np.bincount(src_X[cross], minlength=W), np.bincount(dst_X[cross], minlength=W),
            np.bincount(src_X[intra], minlength=W), np.bincount(dst_X[intra], minlength=W))


def deepspeed_rows(topk_TK: np.ndarray, src_T: np.ndarray, E: int, N: int, G: int, *,
                   padded: bool = True, capacity_factor: float | None = 1.25, min_capacity: int = 4) -> LayerRows:
    """DeepSpeed's all-to-all on the contiguous layout. `padded`: `[E, C]` buffers from every GPU to every GPU,
    C = max(min_capacity, ceil(tokens_per_gpu / E * capacity_factor * K)) (DeepSpeed's `_capacity` with
    `capacity_factor * k`), or the largest (GPU, expert) count when `capacity_factor is None`.
    Not padded: one row per (token, expert) (ideal dropless)."""
    W = N * G
    if padded:
        K = topk_TK.shape[1]
        valid_TK = topk_TK >= 0
        tokens_W = np.bincount(src_T, minlength=W)
        if capacity_factor is None:
            count_WE = np.bincount((src_T[:, None] * E + topk_TK)[valid_TK], minlength=W * E)
            C = int(count_WE.max()) if count_WE.size else 0
        else:
            C = int(max(min_capacity, np.ceil(tokens_W.max() / E * capacity_factor * K))) if tokens_W.size else 0
        return padded_rows(E, C, W, G)
    return dropless_rows(topk_TK, src_T, np.arange(E) // (E // W), W, G)


def dropless_rows(topk_TK: np.ndarray, src_T: np.ndarray, owner_rank_E: np.ndarray, W: int, G: int) -> LayerRows:
    """A dropless all-to-all with uneven splits on any owner layout (`owner_rank_E`: each expert's owner GPU): one
    row per (token, expert) to the expert's owner (AutoEP's exchange)."""
    valid_TK = topk_TK >= 0
    zero = np.zeros(W, dtype=np.int64)
    src_X = np.broadcast_to(src_T[:, None], topk_TK.shape)[valid_TK]
    dst_X = owner_rank_E[topk_TK[valid_TK]]
    io, ii, ao, ai = _pair_rows(src_X, dst_X, W, G)
    return LayerRows(io, ii, ao, ai, np.bincount(dst_X, minlength=W), zero, zero)


def padded_rows(E: int, C: int, W: int, G: int) -> LayerRows:
    """DeepSpeed's padded all-to-all (and the dense schedule): `[E / W, C]` rows from every GPU to every GPU."""
    chunk = (E // W) * C  # rows from one GPU to one GPU
    inter = np.full(W, (W - G) * chunk, dtype=np.int64)
    intra = np.full(W, (G - 1) * chunk, dtype=np.int64)
    zero = np.zeros(W, dtype=np.int64)
    return LayerRows(inter, inter, intra, intra, np.full(W, E * C, dtype=np.int64), zero, zero)


def cobalt_rows(topk_TK: np.ndarray, src_T: np.ndarray, slots_WS: np.ndarray, G: int,
                dest_TK: np.ndarray | None = None) -> LayerRows:
    """ds_cobalt's two-stage dispatch (runtime/dispatch.py) on `slots_WS` with replicas from `assign_tasks`
    (or the given `[T, K]` destination ranks `dest_TK`, -1 = dropped)."""
    W = slots_WS.shape[0]
    N = W // G
    if dest_TK is None:
        dest_TK, _ = assign_tasks(topk_TK, src_T, slots_WS, G)
    valid_TK = dest_TK >= 0
    t_X = np.broadcast_to(np.arange(topk_TK.shape[0])[:, None], dest_TK.shape)[valid_TK]
    dst_X = dest_TK[valid_TK]
    src_X = src_T[t_X]
    remote_X = dst_X // G != src_X // G
    # Stage 1 (rail): one row per (token, remote node), from (n, g) to (n', g).
    pairs = np.unique(t_X[remote_X] * N + dst_X[remote_X] // G)
    pair_src = src_T[pairs // N]
    pair_dst = (pairs % N) * G + pair_src % G
    inter_out = np.bincount(pair_src, minlength=W)
    inter_in = np.bincount(pair_dst, minlength=W)
    route_dst = (dst_X[remote_X] // G) * G + src_X[remote_X] % G
    routes_out = np.bincount(src_X[remote_X], minlength=W)
    routes_in = np.bincount(route_dst, minlength=W)
    # Stage 2 (intra-node): the relay (source for local routes, rail peer for remote ones) forwards per route.
    relay_X = np.where(remote_X, (dst_X // G) * G + src_X % G, src_X)
    fwd = relay_X != dst_X
    intra_out = np.bincount(relay_X[fwd], minlength=W)
    intra_in = np.bincount(dst_X[fwd], minlength=W)
    return LayerRows(inter_out, inter_in, intra_out, intra_in, np.bincount(dst_X, minlength=W), routes_out,
                     routes_in)


def direct_rows(topk_TK: np.ndarray, src_T: np.ndarray, slots_WS: np.ndarray, G: int,
                dest_TK: np.ndarray | None = None) -> LayerRows:
    """ds_cobalt's direct schedule: tasks assigned on the flat view (every GPU its own node), one row per
    (token, destination GPU) plus its routes; cross-node vs same-node by the destination's node. `dest_TK`:
    the destination ranks, if already assigned."""
    W = slots_WS.shape[0]
    if dest_TK is None:
        dest_TK, _ = assign_tasks(topk_TK, src_T, slots_WS, 1)
    valid_TK = dest_TK >= 0
    t_X = np.broadcast_to(np.arange(topk_TK.shape[0])[:, None], dest_TK.shape)[valid_TK]
    dst_X = dest_TK[valid_TK]
    src_X = src_T[t_X]
    pairs = np.unique(t_X * W + dst_X)
    io, ii, ao, ai = _pair_rows(src_T[pairs // W], pairs % W, W, G)
    routes = (src_X != dst_X)
    cross = routes & (src_X // G != dst_X // G)
    return LayerRows(io, ii, ao, ai, np.bincount(dst_X, minlength=W), np.bincount(src_X[cross], minlength=W),
                     np.bincount(dst_X[cross], minlength=W))


def _transfer_time(hw: Hardware, G: int, bytes_out_W: np.ndarray, bytes_in_W: np.ndarray, inter: bool) -> float:
    """Seconds for the slowest GPU (and, across nodes, the slowest node link) to move its bytes."""
    if inter:
        per_gpu = max(bytes_out_W.max(initial=0), bytes_in_W.max(initial=0)) / hw.inter_node_bw_gpu
        node_out, node_in = bytes_out_W.reshape(-1, G).sum(1), bytes_in_W.reshape(-1, G).sum(1)
        per_node = max(node_out.max(initial=0), node_in.max(initial=0)) / hw.inter_node_bw_node
        return float(max(per_gpu, per_node))
    return float(max(bytes_out_W.max(initial=0), bytes_in_W.max(initial=0)) / hw.intra_node_bw)


def _stage_time(hw: Hardware, G: int, bytes_out_W: np.ndarray, bytes_in_W: np.ndarray, inter: bool,
                peers: int) -> float:
    """One all-to-all collective: overhead + latency per peer + the slowest transfer."""
    if peers <= 0:
        return 0.0
    return hw.collective_overhead_s + hw.latency_s * peers + _transfer_time(hw, G, bytes_out_W, bytes_in_W, inter)


def _all_to_all_time(hw: Hardware, G: int, inter_out: np.ndarray, inter_in: np.ndarray, intra_out: np.ndarray,
                     intra_in: np.ndarray) -> float:
    """One all-to-all over the whole EP group (bytes per GPU): cross-node and same-node parts at once."""
    W = inter_out.size
    if W == 1:
        return 0.0
    inter = _transfer_time(hw, G, inter_out, inter_in, True) if W > G else 0.0
    intra = _transfer_time(hw, G, intra_out, intra_in, False) if G > 1 else 0.0
    return hw.collective_overhead_s + hw.latency_s * (W - 1) + max(inter, intra)


def layer_times(rows: LayerRows, variant: str, hw: Hardware, shape: ModelShape, G: int,
                replicas: ReplicaFetch | None = None, dropless: bool = False,
                count_exchange: bool = False) -> dict[str, float]:
    """Seconds of one layer, forward + backward: `comm_s`, `compute_s`, `total_s` (see docs/simulator.md), and
    `inter_node_bytes`: bytes the busiest node sends to other nodes (forward + backward). `replicas`: the layout's
    replica weights (`replica_fetch`), fetched in forward and returned as gradients in backward (not by DeepSpeed or
    the dense schedule). `dropless`: the capacity comes from an all-reduce (DeepSpeed's gate, the dense schedule)
    that costs one collective. `count_exchange`: `deepspeed-dropless` starts with a count all-to-all (AutoEP's
    exchange, which is the dense schedule of AutoEP layers)."""
    W = rows.compute_W.size
    N = W // G
    b = shape.row_bytes
    compute_fwd = float(rows.compute_W.max(initial=0)) * shape.flops_per_row / hw.gemm_flops
    compute = 3.0 * compute_fwd  # backward: two GEMMs per forward GEMM
    reduce = hw.collective_overhead_s + hw.latency_s * (W - 1) if dropless and W > 1 else 0.0
    node_of_rows = lambda out_W: float(out_W.reshape(-1, G).sum(1).max(initial=0))  # noqa: E731
    if variant.startswith("deepspeed") or variant == "cobalt-dense":
        # One all-to-all moves inter- and intra-node rows at once (W - 1 peers); 2 in forward, 2 in backward.
        a2a = _all_to_all_time(hw, G, rows.inter_out_W * b, rows.inter_in_W * b, rows.intra_out_W * b,
                               rows.intra_in_W * b)
        comm = 4 * a2a + (reduce if variant != "deepspeed-dropless" else 0.0)
        if count_exchange:
            zeros = np.zeros(W, dtype=np.int64)
            comm += _all_to_all_time(hw, G, zeros, zeros, zeros, zeros)
        return {"comm_s": comm, "compute_s": compute, "total_s": comm + compute,
                "inter_node_bytes": 4.0 * b * node_of_rows(rows.inter_out_W)}
    if not variant.startswith("cobalt"):
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    zeros = np.zeros(W, dtype=np.int64)
    counts = _all_to_all_time(hw, G, zeros, zeros, zeros, zeros)  # one count exchange over the EP group
    replica = 0.0  # replicas: weights copied in (forward), gradients back to the owner (backward), one exchange each
    if replicas is not None and not replicas.empty and variant != "cobalt-dense":
        replica = 2 * _all_to_all_time(hw, G, replicas.inter_out_W, replicas.inter_in_W, replicas.intra_out_W,
                                       replicas.intra_in_W)
    route_bytes = _ROUTE_BYTES * rows.routes_out_W
    node_bytes = node_of_rows(4.0 * b * rows.inter_out_W + 2.0 * route_bytes)
    if variant == "cobalt-direct":
        # forward: counts, rows + routes, rows back; backward: the gradients of both, the other way
        there = _all_to_all_time(hw, G, rows.inter_out_W * b + route_bytes, rows.inter_in_W * b
                                 + _ROUTE_BYTES * rows.routes_in_W, rows.intra_out_W * b, rows.intra_in_W * b)
        back = _all_to_all_time(hw, G, rows.inter_in_W * b, rows.inter_out_W * b, rows.intra_in_W * b,
                                rows.intra_out_W * b)
        comm = counts + 2 * (there + back) + replica
        return {"comm_s": comm, "compute_s": compute, "total_s": comm + compute, "inter_node_bytes": node_bytes}

    def rail(out_W: np.ndarray, in_W: np.ndarray) -> float:
        return _stage_time(hw, G, out_W, in_W, True, N - 1)

    def node(out_W: np.ndarray, in_W: np.ndarray) -> float:
        return _stage_time(hw, G, out_W, in_W, False, G - 1)

    rail_rows = rail(rows.inter_out_W * b, rows.inter_in_W * b)
    node_rows = node(rows.intra_out_W * b, rows.intra_in_W * b)
    if variant == "cobalt-overlap":
        # runtime/overlap.py: per rail chunk a rail count exchange, rows and routes apart; node counts per round
        chunks = hw.overlap_chunks
        counts = rail(zeros, zeros) + node(zeros, zeros)
        routes = rail(route_bytes, _ROUTE_BYTES * rows.routes_in_W)
        fwd_data = 2 * rail_rows + routes + 2 * node_rows
        bwd_data = 2 * rail_rows + 2 * node_rows + routes
        total = counts
        for data, comp in ((fwd_data + replica / 2, compute_fwd), (bwd_data + replica / 2, 2 * compute_fwd)):
            total += max(data, comp) + min(data, comp) / chunks
        return {"comm_s": counts + fwd_data + bwd_data + replica, "compute_s": compute, "total_s": total,
                "inter_node_bytes": node_bytes}
    # hierarchical: counts, rail rows + routes (one message), node rows, node back, rail back; backward mirrors
    rail_out = rail(rows.inter_out_W * b + route_bytes, rows.inter_in_W * b + _ROUTE_BYTES * rows.routes_in_W)
    comm = counts + 2 * (rail_out + 2 * node_rows + rail_rows) + replica
    return {"comm_s": comm, "compute_s": compute, "total_s": comm + compute, "inter_node_bytes": node_bytes}


def step_of_tokens(src_T: np.ndarray, W: int, step_tokens: int) -> np.ndarray:
    """`[T]` step of every token: each rank's tokens, in trace order, form its blocks of `step_tokens / W`
    tokens per step (works for step-major and for rank-major traces such as `train_moe.py --trace-out`)."""
    per_rank = max(1, step_tokens // W)
    if src_T.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(src_T, kind="stable")
    counts = np.bincount(src_T, minlength=W)
    ordinal = np.empty_like(src_T)
    ordinal[order] = np.arange(src_T.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return ordinal // per_rank


def predict_step_times(
    trace: Trace, layout: Layout, hw: Hardware, shape: ModelShape, *, step_tokens: int | None = None,
    capacity_factor: float | None = 1.25, min_capacity: int = 4, variants: tuple[str, ...] = VARIANTS,
    layer_scale: float = 1.0, rows_scale: float = 1.0,
) -> dict:
    """Mean predicted seconds per step of the MoE layers, per variant, and speedups vs `deepspeed`.

    The trace is cut into consecutive steps of `step_tokens` tokens (default: one step); every trace layer
    is one MoE layer, times `layer_scale` (e.g. model layers / trace layers for a one-layer synthetic trace).
    `rows_scale` multiplies every row count (a sampled trace standing for more tokens per step).
    DeepSpeed variants use the contiguous layout; cobalt variants use `layout`.
    Returns `{"step_s": {variant: s}, "comm_s": {...}, "compute_s": {...}, "inter_node_bytes": {...} (busiest
    node, per step), "speedup_vs_deepspeed": {...}, "steps": n}`.
    """
    E, N, G = layout.num_experts, layout.nodes, layout.gpus_per_node
    if trace.num_experts != E:
        raise ValueError(f"trace has num_experts={trace.num_experts} but the layout has {E}")
    layout = owners_first(layout)  # replica pricing reads the owners from the first E / W slots
    W = N * G
    T = trace.num_tokens
    step_tokens = T if not step_tokens else int(step_tokens)
    if step_tokens < 1 or T < step_tokens:
        raise ValueError(f"step_tokens must be in [1, {T}] (tokens in the trace), got {step_tokens}")
    steps = T // step_tokens
    src_T = trace.source_ranks(W)
    step_T = step_of_tokens(src_T, W, step_tokens)
    order = np.argsort(step_T, kind="stable")
    bounds = np.searchsorted(step_T[order], np.arange(steps + 1))
    variants = tuple(dict.fromkeys(variants))
    acc = {key: dict.fromkeys(variants, 0.0) for key in ("step_s", "comm_s", "compute_s", "inter_node_bytes")}
    for layer in range(trace.num_layers):
        slots_WS = layout.layer(min(layer, layout.num_layers - 1))
        replicas = replica_fetch(slots_WS, E, G, shape.expert_bytes)
        for step in range(steps):
            chunk = order[bounds[step] : bounds[step + 1]]
            topk_TK, src = trace.experts_LTK[layer, chunk], src_T[chunk]
            cache: dict[str, LayerRows] = {}
            for v in variants:
                if v == "deepspeed":
                    rows = cache.setdefault(v, deepspeed_rows(topk_TK, src, E, N, G, padded=True,
                                                              capacity_factor=capacity_factor,
                                                              min_capacity=min_capacity))
                elif v == "deepspeed-dropless":
                    rows = cache.setdefault(v, deepspeed_rows(topk_TK, src, E, N, G, padded=False))
                elif v == "cobalt-dense":
                    rows = cache.setdefault("deepspeed", deepspeed_rows(topk_TK, src, E, N, G, padded=True,
                                                                        capacity_factor=capacity_factor,
                                                                        min_capacity=min_capacity))
                elif v == "cobalt-direct":
                    rows = cache.setdefault(v, direct_rows(topk_TK, src, slots_WS, G))
                else:
                    if "cobalt" not in cache:
                        cache["cobalt"] = cobalt_rows(topk_TK, src, slots_WS, G)
                    rows = cache["cobalt"]
                if rows_scale != 1.0:
                    rows = scaled_rows(rows, rows_scale)
                t = layer_times(rows, v, hw, shape, G, replicas if v.startswith("cobalt") else None,
                                dropless=capacity_factor is None)
                acc["step_s"][v] += t["total_s"] * layer_scale / steps
                acc["comm_s"][v] += t["comm_s"] * layer_scale / steps
                acc["compute_s"][v] += t["compute_s"] * layer_scale / steps
                acc["inter_node_bytes"][v] += t["inter_node_bytes"] * layer_scale / steps
    out: dict = {**acc, "steps": steps}
    if "deepspeed" in variants:
        base = acc["step_s"]["deepspeed"]
        out["speedup_vs_deepspeed"] = {v: base / s if s > 0 else float("inf") for v, s in acc["step_s"].items()}
    return out


def predict_synthetic(shape: ModelShape, hw: Hardware, gpus: int, *, redundant_slots: int = 1,
                      sample_tokens_per_gpu: int = 1024, gini: float = 0.3, clustering: float = 0.6,
                      capacity_factor: float | None = 1.25, seed: int = 0) -> dict:
    """Predict a `gpus`-GPU job of `shape` from a synthetic trace (`sim/synth.py`, one layer scaled to
    `shape.moe_layers`). The expert-parallel group is min(gpus, E) GPUs (the rest is data parallel); the
    cobalt layout is planned on one half of the tokens and scored on the other half, its traffic copies priced
    by their weights' bytes as the runtime's re-plans price them (`planner.migration.copy_cost_per_token`). Rows
    are counted on `sample_tokens_per_gpu` tokens per GPU and scaled to `shape.tokens_per_gpu` (times are linear
    in rows)."""
    from ..planner.migration import LinkModel, copy_cost_per_token
    from ..planner.policies import plan_layout
    from .synth import synth_trace

    E = shape.num_experts
    ep = min(gpus, E)
    if E % ep:
        raise ValueError(f"{gpus} GPUs: the expert-parallel group min(gpus, E)={ep} does not divide E={E}")
    G = min(hw.gpus_per_node, ep)
    N = ep // G
    if N * G != ep:
        raise ValueError(f"expert-parallel group of {ep} GPUs is not a whole number of {G}-GPU nodes")
    T = ep * sample_tokens_per_gpu
    full = synth_trace(num_experts=E, top_k=shape.top_k, num_tokens=2 * T, gini=gini, clustering=clustering,
                       seed=seed)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(2 * T)
    plan_on, score_on = full.select_tokens(np.sort(perm[:T])), full.select_tokens(np.sort(perm[T:]))
    # Tokens live on their GPU in contiguous blocks (the default source rank).
    score_on = Trace(score_on.experts_LTK, E)
    link = LinkModel(expert_params=shape.ffn_matrices * shape.hidden * shape.ffn,
                     weight_bytes_per_param=shape.dtype_bytes, token_bytes=shape.row_bytes)
    copy_cost = copy_cost_per_token(link, ep * shape.tokens_per_gpu)
    # the part of a node's inter-node bandwidth one GPU can use alone, as `_transfer_time` prices it
    gpu_link_share = min(1.0, max(1.0 / G, hw.inter_node_bw_gpu / hw.inter_node_bw_node))
    cobalt = plan_layout(Trace(plan_on.experts_LTK, E), N, G, redundant_slots if G > 1 or N > 1 else 0, "cobalt",
                         seed=seed, copy_cost=copy_cost, copy_gpu_link_share=gpu_link_share)
    scale = shape.tokens_per_gpu / sample_tokens_per_gpu
    # Rows (padded capacity included) grow linearly with tokens; latency and overheads do not.
    pred = predict_step_times(score_on, cobalt, hw, shape, capacity_factor=capacity_factor,
                              layer_scale=shape.moe_layers, rows_scale=scale)
    spares_used = keep_faster_without_spares(pred, score_on, cobalt, hw, shape, capacity_factor, scale)
    pred.update(gpus=gpus, ep=ep, nodes=N, gpus_per_node=G, model=shape.name, hardware=hw.name,
                redundant_slots=redundant_slots, sample_tokens_per_gpu=sample_tokens_per_gpu,
                tokens_per_gpu=shape.tokens_per_gpu, copy_cost=copy_cost, spare_slots_used=spares_used)
    return pred


# the schedules whose spare slots `planner.stage2: "auto"` may leave unused where that is faster (the runtime times
# replicas against none in the phased hierarchical and the direct schedule; the overlapped one keeps the replicas)
STAGE2_CHOICE_VARIANTS = ("cobalt", "cobalt-direct")


def keep_faster_without_spares(pred: dict, trace: Trace, layout: Layout, hw: Hardware, shape: ModelShape,
                                capacity_factor: float | None, rows_scale: float) -> dict[str, bool]:
    """For `STAGE2_CHOICE_VARIANTS`, replace `pred`'s figures by those of `layout` with its spare slots empty
    where they are faster (each replica fetches its weights and returns their gradients every step). Returns,
    per variant, whether the spare slots are used."""
    if layout.slots_per_gpu == layout.num_experts // layout.world_size:
        return dict.fromkeys(STAGE2_CHOICE_VARIANTS, False)
    bare_LWS = layout.slots_LWS.copy()
    bare_LWS[:, :, layout.num_experts // layout.world_size:] = -1
    bare = predict_step_times(trace, Layout(layout.num_experts, layout.nodes, layout.gpus_per_node, bare_LWS), hw,
                              shape, variants=STAGE2_CHOICE_VARIANTS, capacity_factor=capacity_factor,
                              layer_scale=shape.moe_layers, rows_scale=rows_scale)
    used = {}
    for v in STAGE2_CHOICE_VARIANTS:
        used[v] = pred["step_s"][v] <= bare["step_s"][v]
        if not used[v]:
            for key in ("step_s", "comm_s", "compute_s", "inter_node_bytes"):
                pred[key][v] = bare[key][v]
            pred["speedup_vs_deepspeed"][v] = pred["step_s"]["deepspeed"] / pred["step_s"][v]
    return used


def format_prediction(pred: dict) -> str:
    """A small table: variant, step time, communication, compute, speedup vs deepspeed."""
    lines = [f"{'variant':<20}{'step ms':>12}{'comm ms':>12}{'compute ms':>12}{'speedup':>10}"]
    for v, s in pred["step_s"].items():
        sp = pred.get("speedup_vs_deepspeed", {}).get(v, float("nan"))
        lines.append(f"{v:<20}{s * 1e3:>12.3f}{pred['comm_s'][v] * 1e3:>12.3f}"
                     f"{pred['compute_s'][v] * 1e3:>12.3f}{sp:>10.3f}")
    if "spare_slots_used" in pred:
        lines.append("spare slots (planner.stage2 auto keeps the faster): " + ", ".join(
            f"{v} {'replicas' if used else 'none'}" for v, used in pred["spare_slots_used"].items()))
    return "\n".join(lines)
