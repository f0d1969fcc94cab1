"""Plot a layout: co-activation heatmap ordered by placement (node boundaries) and per-GPU load bars.

Legend: E experts, N nodes, G GPUs per node, W ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..planner.assign import assign_tasks
from ..planner.layout import Layout
from ..planner.stats import count_routing
from ..planner.trace import Trace

__all__ = ["plot_layout"]


def plot_layout(trace: Trace, layout: Layout, path: str | Path, layer: int = 0) -> None:
    """Write a png for one layer (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    E, N, G = layout.num_experts, layout.nodes, layout.gpus_per_node
    topk_TK = trace.experts_LTK[layer]
    slots_WS = layout.layer(min(layer, layout.num_layers - 1))
    _, coact_EE = count_routing(topk_TK, E)
    # Experts ordered by owner rank, so node blocks are contiguous.
    order_E = slots_WS[:, : E // layout.world_size].reshape(-1)
    src_T = trace.source_ranks(layout.world_size)
    dest_TK, _ = assign_tasks(topk_TK, src_T, slots_WS, G)
    load_W = np.bincount(dest_TK[dest_TK >= 0], minlength=layout.world_size)

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 5.5))
    im = ax0.imshow(np.log1p(coact_EE[np.ix_(order_E, order_E)]), cmap="viridis", interpolation="nearest")
    for b in range(1, N):
        ax0.axhline(b * E / N - 0.5, color="w", lw=0.8)
        ax0.axvline(b * E / N - 0.5, color="w", lw=0.8)
    ax0.set_title(f"layer {layer}: log(1 + co-activation), experts by owner node")
    fig.colorbar(im, ax=ax0, shrink=0.8)
    colors = plt.cm.tab10(np.arange(layout.world_size) // G % 10)
    ax1.bar(np.arange(layout.world_size), load_W, color=colors)
    if load_W.sum():
        ax1.axhline(load_W.mean(), color="k", ls="--", lw=0.8, label="mean")
        ax1.legend()
    ax1.set_xlabel("global rank (color = node)")
    ax1.set_ylabel("(token, expert) pairs")
    ax1.set_title(f"GPU load, max/mean = {load_W.max() / max(load_W.mean(), 1e-12):.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
