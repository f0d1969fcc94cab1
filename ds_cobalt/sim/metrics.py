"""Simulated cost of a layout on a routing trace (dispatch direction).

Legend: L layers, T tokens, K top-k, E experts, N nodes, G GPUs per node, W ranks, S slots.

Metrics per layer (the `ds-cobalt simulate` contract):
- `cross_node_tokens_per_token`: distinct remote nodes a token is sent to, averaged over tokens, with the
  replicas chosen by `assign_tasks`.
- `deepspeed_cross_node_pairs_per_token`: (token, expert) pairs whose expert sits on a remote node under
  DeepSpeed's contiguous layout (DeepSpeed sends one copy per pair), averaged over tokens.
- `gpu_load_max_over_mean`, `node_load_max_over_mean`: (token, expert) pairs served per rank / node.
"""

from __future__ import annotations

import numpy as np

from ..planner.assign import assign_tasks, remote_nodes_per_token
from ..planner.layout import Layout
from ..planner.stage2 import max_over_mean
from ..planner.trace import Trace

__all__ = ["METRICS", "layer_metrics", "deepspeed_pairs_per_token", "simulate", "mean_metrics"]

METRICS = (
    "cross_node_tokens_per_token",
    "deepspeed_cross_node_pairs_per_token",
    "gpu_load_max_over_mean",
    "node_load_max_over_mean",
)




def deepspeed_pairs_per_token(
    topk_ids_TK: np.ndarray, source_rank_T: np.ndarray, num_experts: int, nodes: int, gpus_per_node: int
) -> float:
    """Mean per token of (token, expert) pairs whose expert is remote under the contiguous layout."""
    T = topk_ids_TK.shape[0]
    if T == 0:
        return 0.0
    per_node = num_experts // nodes
    valid = topk_ids_TK >= 0
    node_TK = np.where(valid, topk_ids_TK, 0) // per_node
    remote = valid & (node_TK != (source_rank_T // gpus_per_node)[:, None])
    return float(remote.sum()) / T


def layer_metrics(
    topk_ids_TK: np.ndarray, source_rank_T: np.ndarray, slots_WS: np.ndarray, num_experts: int, nodes: int,
    gpus_per_node: int,
) -> dict[str, float]:
    """The METRICS of one layer (see module docstring)."""
    T = topk_ids_TK.shape[0]
    W = nodes * gpus_per_node
    dest_rank_TK, _ = assign_tasks(topk_ids_TK, source_rank_T, slots_WS, gpus_per_node)
    served = dest_rank_TK[dest_rank_TK >= 0]
    load_W = np.bincount(served, minlength=W)
    load_N = load_W.reshape(nodes, gpus_per_node).sum(axis=1)
    remote_T = remote_nodes_per_token(dest_rank_TK, source_rank_T, gpus_per_node)
    return {
        "cross_node_tokens_per_token": float(remote_T.mean()) if T else 0.0,
        "deepspeed_cross_node_pairs_per_token": deepspeed_pairs_per_token(
            topk_ids_TK, source_rank_T, num_experts, nodes, gpus_per_node
        ),
        "gpu_load_max_over_mean": max_over_mean(load_W),
        "node_load_max_over_mean": max_over_mean(load_N),
    }


def mean_metrics(per_layer: list[dict[str, float]]) -> dict[str, float]:
    return {m: float(np.mean([row[m] for row in per_layer])) if per_layer else 0.0 for m in METRICS}


def check_compatible(trace: Trace, layout: Layout) -> None:
    """ValueError when a trace cannot be simulated on a layout."""
    if trace.num_experts != layout.num_experts:
        raise ValueError(f"trace has num_experts={trace.num_experts} but the layout has {layout.num_experts}")
    if layout.num_layers not in (1, trace.num_layers):
        raise ValueError(
            f"layout has {layout.num_layers} layers but the trace has {trace.num_layers} (need equal, or 1 layer)"
        )


def simulate(trace: Trace, layout: Layout) -> dict:
    """Metrics per layer and their mean: `{"layers": [ {metric: value} ], "mean": {metric: value}}`."""
    check_compatible(trace, layout)
    src_T = trace.source_ranks(layout.world_size)
    per_layer = []
    for layer in range(trace.num_layers):
        slots_WS = layout.layer(layer if layout.num_layers > 1 else 0)
        per_layer.append(
            layer_metrics(trace.experts_LTK[layer], src_T, slots_WS, layout.num_experts, layout.nodes,
                          layout.gpus_per_node)
        )
    return {"layers": per_layer, "mean": mean_metrics(per_layer)}
