"""Step-by-step replay of a trace with the two-timescale policy.

Legend: L layers, T tokens, K top-k, E experts, N nodes, G GPUs per node, W ranks, S slots.

Tokens are cut into `steps` equal consecutive chunks. Per layer: statistics are exponentially averaged
(`RoutingStats`); every `replan_interval` steps stage 1 + 2 (`cobalt` policy) replans from them and the
new owners are adopted when the migration cost model says so; every step stage 2 refills the spare slots
with replicas of each node's hottest experts (predicted load); each step is scored with the exact
per-step task assignment.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..planner.layout import Layout, canonical_owner_order
from ..planner.migration import LinkModel, migration_worth_it, moved_experts
from ..planner.policies import LayerInput, cobalt_policy
from ..planner.stage2 import refill_node
from ..planner.stats import RoutingStats
from ..planner.trace import Trace
from .metrics import check_compatible, layer_metrics, mean_metrics

__all__ = ["replay", "refresh_spares"]


def refresh_spares(slots_WS: np.ndarray, keep_WS: np.ndarray, load_E: np.ndarray, gpus_per_node: int,
                   num_experts: int) -> np.ndarray:
    """Stage 2 per step: refill spare slots not marked in `keep_WS` with replicas of the node's hottest
    experts (`planner.stage2.refill_node` per node, on the predicted loads in thousandths of a route)."""
    G, O = gpus_per_node, num_experts // slots_WS.shape[0]
    free_WS = np.zeros(slots_WS.shape, dtype=bool)
    free_WS[:, O:] = ~keep_WS[:, O:]
    out = slots_WS.copy()
    for n in range(slots_WS.shape[0] // G):
        rows = slice(n * G, (n + 1) * G)
        out[rows] = refill_node(slots_WS[rows], free_WS[rows], np.rint(np.asarray(load_E) * 1000))[0]
    return out


def replay(
    trace: Trace,
    layout: Layout,
    *,
    steps: int = 16,
    replan_interval: int = 4,
    decay: float = 0.7,
    link: LinkModel = LinkModel(),  # noqa: B008 - frozen dataclass
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Replay `trace` in `steps` steps starting from `layout`; metrics per layer (mean over steps)."""
    check_compatible(trace, layout)
    if steps < 1 or replan_interval < 1:
        raise ValueError(f"steps and replan_interval must be >= 1, got {steps} and {replan_interval}")
    E, N, G = layout.num_experts, layout.nodes, layout.gpus_per_node
    W = N * G
    src_T = trace.source_ranks(W)
    bounds = np.linspace(0, trace.num_tokens, steps + 1).astype(np.int64)
    per_layer, replans, migrations = [], 0, 0
    for layer in range(trace.num_layers):
        topk_LTK = trace.experts_LTK[layer]
        slots = layout.layer(min(layer, layout.num_layers - 1)).copy()
        keep = np.zeros_like(slots, dtype=bool)  # spare slots chosen by stage 1 (kept between replans)
        stats = RoutingStats(E, trace.top_k, decay=decay)
        window: list[slice] = []
        rows = []
        for step in range(steps):
            chunk = slice(int(bounds[step]), int(bounds[step + 1]))
            if step and step % replan_interval == 0:
                # Stage 1 + 2 from the averaged statistics, sampled on the last interval's tokens.
                recent = np.r_[tuple(np.arange(s.start, s.stop) for s in window[-replan_interval:])]
                inp = LayerInput(stats, topk_LTK[recent], src_T[recent], N, G, slots.shape[1] - E // W, slots)
                new = canonical_owner_order(Layout(E, N, G, cobalt_policy(inp)[None])).layer(0)
                old_m = layer_metrics(topk_LTK[recent], src_T[recent], slots, E, N, G)
                new_m = layer_metrics(topk_LTK[recent], src_T[recent], new, E, N, G)
                replans += 1
                old_nodes = _owner_nodes(slots, E, G)
                moved = moved_experts(old_nodes, _owner_nodes(new, E, G))
                if moved == 0 or migration_worth_it(
                    moved, old_m["cross_node_tokens_per_token"], new_m["cross_node_tokens_per_token"],
                    recent.size // replan_interval, replan_interval, link,
                ):
                    migrations += int(moved > 0)
                    slots = new
                    keep = _cross_node_replicas(slots, E, G)
            elif step:
                # Stage 2: spare slots follow the predicted (averaged) load.
                slots = refresh_spares(slots, keep, stats.load_E, G, E)
            rows.append(layer_metrics(topk_LTK[chunk], src_T[chunk], slots, E, N, G))
            stats.update(topk_LTK[chunk])
            window.append(chunk)
        per_layer.append(mean_metrics(rows))
        if progress is not None:
            progress(layer)
    return {"layers": per_layer, "mean": mean_metrics(per_layer), "replans": replans, "migrations": migrations}


def _owner_nodes(slots_WS: np.ndarray, E: int, G: int) -> np.ndarray:
    W = slots_WS.shape[0]
    owners = slots_WS[:, : E // W]
    node_of_E = np.empty(E, dtype=np.int64)
    node_of_E[owners.reshape(-1)] = np.repeat(np.arange(W) // G, E // W)
    return node_of_E


def _cross_node_replicas(slots_WS: np.ndarray, E: int, G: int) -> np.ndarray:
    """`[W, S]` bool: spare slots holding an expert owned on another node."""
    node_of_E = _owner_nodes(slots_WS, E, G)
    W = slots_WS.shape[0]
    node_W = np.arange(W) // G
    held = np.where(slots_WS >= 0, node_of_E[np.maximum(slots_WS, 0)], -1)
    keep = (slots_WS >= 0) & (held != node_W[:, None])
    keep[:, : E // W] = False
    return keep
