"""The cost model behind `transport.schedule: "auto"`: each schedule's communication time for one layer.

It is the simulator's model (`ds_cobalt.sim.cluster.layer_times`: a fixed cost per collective plus the slowest
rank's bytes over the link they cross), on the probed `LinkCosts` of the real groups and on rows counted from
this layer's routing under its current layout: every rank contributes its first `sample_tokens` routes (one
all-gather, once per layout), and all ranks then compute the same numbers. Compute and CPU work are not in it
(the same model would need per-schedule CPU costs that differ by machine), so the model only decides where
communication alone settles it, and the timed steps (`StepTimedChoice`) decide the rest.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..sim.cluster import cobalt_rows, direct_rows, dropless_rows, layer_times, padded_rows, replica_fetch, scaled_rows
from ..sim.hardware import Hardware, ModelShape
from .comm import group_size
from .link_probe import LinkCosts
from .placement import assign_tasks, build_placement
from .topology import EPGroups

_SIM_VARIANT = {"hierarchical": "cobalt", "direct": "cobalt-direct", "dense": "cobalt-dense"}


def hardware_of(costs: LinkCosts, ranks_per_node: int) -> Hardware:
    """The simulator's `Hardware` for the probed links: every rank of a node sends across at once in the probe,
    so a node's link carries `ranks_per_node` times one rank's rate."""
    inter = costs.inter_node_bytes_per_s
    return Hardware(name="probed", gpus_per_node=ranks_per_node, inter_node_bw_gpu=inter,
                    inter_node_bw_node=inter * ranks_per_node, intra_node_bw=costs.intra_node_bytes_per_s,
                    latency_s=0.0, collective_overhead_s=costs.fixed_s, gemm_flops=float("inf"),
                    source="runtime/link_probe.py")


def gather_routing(topk_ids_TK: torch.Tensor, groups: EPGroups, sample_tokens: int,
                   capacity: torch.Tensor | int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """On every rank, through one all-gather over the EP group: `[X, K]` sampled routes of every EP rank (its
    first `sample_tokens` tokens), `[X]` their EP ranks, tokens per sampled token, and `[W]` each rank's
    `capacity` (C of the dense schedule)."""
    T, K = topk_ids_TK.shape
    sample = torch.full((sample_tokens + 2, K), -1, dtype=torch.int64, device=topk_ids_TK.device)
    n = min(T, sample_tokens)
    sample[:n] = topk_ids_TK[:n].to(torch.int64)
    sample[-2, 0] = T  # the rank's token count and capacity ride along
    sample[-1, 0] = torch.as_tensor(capacity, device=sample.device).to(torch.int64)
    W = group_size(groups.ep_group)
    if W > 1:
        parts = [torch.empty_like(sample) for _ in range(W)]
        dist.all_gather(parts, sample, group=groups.ep_group)
        gathered = torch.stack(parts)
    else:
        gathered = sample[None]
    gathered = gathered.cpu().numpy()  # NOTE: host sync, once per layout
    routes = gathered[:, :-2]
    keep = (routes >= 0).any(axis=2)
    src = np.broadcast_to(np.arange(W)[:, None], keep.shape)[keep]
    scale = float(gathered[:, -2, 0].sum()) / max(int(keep.sum()), 1)
    return routes[keep], src, scale, gathered[:, -1, 0]


def _destinations(topk_XK: np.ndarray, src_X: np.ndarray, slots_WS: np.ndarray, ranks_per_node: int,
                  num_experts: int) -> np.ndarray:
    """`[X, K]` destination ranks as the runtime assigns them (`placement.assign_tasks`, per source rank)."""
    placement = build_placement(slots_WS, ranks_per_node, num_experts)
    dest = np.full(topk_XK.shape, -1, dtype=np.int64)
    topk = torch.from_numpy(np.ascontiguousarray(topk_XK))
    for src in np.unique(src_X):
        rows = np.flatnonzero(src_X == src)
        dest[rows] = assign_tasks(topk[torch.from_numpy(rows)], placement, int(src))[0].numpy()
    return dest


def predict_comm_seconds(candidates: list[str], topk_XK: np.ndarray, src_X: np.ndarray, scale: float,
                         slots_WS: np.ndarray, ranks_per_node: int, num_experts: int, capacity: int,
                         row_bytes: int, hardware: Hardware, dropless: bool,
                         expert_bytes: int = 0, native_dense: bool = False) -> dict[str, float]:
    """Predicted communication seconds of one layer, forward + backward, per candidate schedule (rows from the
    runtime's own task assignment: the hierarchical schedule's on the real nodes, the direct one's on the flat
    view, every rank its own node). `expert_bytes`: one expert's weights, which each spare slot holding another
    rank's expert fetches in forward and returns as gradients in backward (hierarchical and direct).
    `native_dense`: dense is AutoEP's exchange (a count all-to-all, then one row per route to its expert's owner)
    instead of DeepSpeed MoE's padded `[E / W, C]` blocks."""
    W = slots_WS.shape[0]
    G = ranks_per_node
    shape = ModelShape(num_experts=num_experts, top_k=max(1, topk_XK.shape[1]), hidden=row_bytes, ffn=1,
                       dtype_bytes=1)
    replicas = replica_fetch(slots_WS, num_experts, G, expert_bytes)
    out = {}
    for c in candidates:
        if c == "dense" and native_dense:
            owner_rank_E = np.empty(num_experts, dtype=np.int64)
            owners = slots_WS[:, :num_experts // W]  # owner slots first; spare slots stay unused by dense
            owner_rank_E[owners.reshape(-1)] = np.repeat(np.arange(W), owners.shape[1])
            rows = scaled_rows(dropless_rows(topk_XK, src_X, owner_rank_E, W, G), scale)
            out[c] = layer_times(rows, "deepspeed-dropless", hardware, shape, G, count_exchange=True)["comm_s"]
            continue
        if c == "dense":
            rows = padded_rows(num_experts, capacity, W, G)
        else:
            ranks_per_node_of = G if c == "hierarchical" else 1
            dest = _destinations(topk_XK, src_X, slots_WS, ranks_per_node_of, num_experts)
            rows = (cobalt_rows if c == "hierarchical" else direct_rows)(topk_XK, src_X, slots_WS, G, dest)
            rows = scaled_rows(rows, scale)
        out[c] = layer_times(rows, _SIM_VARIANT[c], hardware, shape, G, replicas if c != "dense" else None,
                             dropless=dropless and c == "dense")["comm_s"]
    return out


def model_pruned(predicted: dict[str, float], fixed_s: float, ratio: float = 2.0, calls: float = 10.0) -> list[str]:
    """Candidates that communication alone rules out: predicted at least `ratio` times the best prediction and
    more than `calls` collectives' fixed cost above it (so CPU work that the model leaves out cannot close the
    gap). The best candidate is never pruned."""
    best = min(predicted.values())
    return [c for c, t in predicted.items() if t >= ratio * best and t - best > calls * fixed_s]
