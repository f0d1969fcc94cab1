"""Step-by-step replay of a trace with the two-timescale policy.

Legend: L layers, T tokens, K top-k, E experts, N nodes, G GPUs per node, W ranks, S slots.

Each source rank's tokens (in trace order) are cut into `steps` equal consecutive chunks; step s takes chunk s of
every rank, as a training step takes a batch on every rank. Per layer: statistics are exponentially averaged
(`RoutingStats`); every `replan_interval` steps stage 1 + 2 (`cobalt` policy) replans from them and the
new owners are adopted when the migration cost model says so. Between re-plans, `stage2` says what the spare
slots that hold no traffic copy do:
- `"step"` (the runtime's default, `runtime/step_spares.py`): each node refills them from the step's own loads
  (the routes the step's task assignment sends to the node) and splits each expert's rows over its copies;
- `"predicted"`: refilled every step from the averaged statistics, rows split as `assign_tasks` splits them;
- `"interval"`: the re-plan's replicas stay until the next re-plan (the runtime's `planner.stage2: "interval"`).
Each step is scored with the exact per-step task assignment.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..planner.assign import assign_tasks
from ..planner.layout import Layout, canonical_owner_order, cross_node_copies, owner_rank_of, owners_first
from ..planner.migration import LinkModel, migration_worth_it, moved_experts
from ..planner.policies import LayerInput, cobalt_policy
from ..planner.stage2 import max_over_mean, refill_layout, refill_node
from ..planner.stats import RoutingStats
from ..planner.trace import Trace
from .metrics import check_compatible, layer_metrics, mean_metrics

__all__ = ["replay", "refresh_spares", "refilled_gpu_loads", "step_tokens", "STAGE2_MODES"]

STAGE2_MODES = ("step", "predicted", "interval")


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
    stage2: str = "step",
) -> dict:
    """Replay `trace` in `steps` steps starting from `layout`; metrics per layer (mean over steps), and the
    medians over every (layer, step) of the GPU and node load max/mean (`step_*_load_max_over_mean_median`)."""
    check_compatible(trace, layout)
    layout = owners_first(layout)
    if steps < 1 or replan_interval < 1:
        raise ValueError(f"steps and replan_interval must be >= 1, got {steps} and {replan_interval}")
    if stage2 not in STAGE2_MODES:
        raise ValueError(f"stage2 must be one of {', '.join(STAGE2_MODES)}, got {stage2!r}")
    E, N, G = layout.num_experts, layout.nodes, layout.gpus_per_node
    W = N * G
    src_T = trace.source_ranks(W)
    busiest = int(np.bincount(src_T, minlength=W).max(initial=0))
    if steps > busiest:
        raise ValueError(f"steps={steps} exceeds the tokens of the busiest source rank ({busiest}): every step needs "
                         "tokens")
    chunks = step_tokens(src_T, W, steps)
    per_layer, replans, migrations, step_gpu, step_node = [], 0, 0, [], []
    for layer in range(trace.num_layers):
        topk_LTK = trace.experts_LTK[layer]
        slots = layout.layer(min(layer, layout.num_layers - 1)).copy()
        keep = cross_node_copies(slots, E, G)  # stage 1's traffic copies (kept between replans)
        stats = RoutingStats(E, trace.top_k, decay=decay)
        window: list[np.ndarray] = []
        rows = []
        for step in range(steps):
            chunk = chunks[step]
            if step and step % replan_interval == 0:
                # Stage 1 + 2 from the averaged statistics, sampled on the last interval's tokens.
                recent = np.concatenate(window[-replan_interval:])
                inp = LayerInput(stats, topk_LTK[recent], src_T[recent], N, G, slots.shape[1] - E // W, slots)
                new = canonical_owner_order(Layout(E, N, G, cobalt_policy(inp)[None])).layer(0)
                old_m = layer_metrics(topk_LTK[recent], src_T[recent], slots, E, N, G)
                new_m = layer_metrics(topk_LTK[recent], src_T[recent], new, E, N, G)
                replans += 1
                old_nodes = owner_rank_of(slots, E) // G
                moved = moved_experts(old_nodes, owner_rank_of(new, E) // G)
                if moved == 0 or migration_worth_it(
                    moved, old_m["cross_node_tokens_per_token"], new_m["cross_node_tokens_per_token"],
                    recent.size // replan_interval, replan_interval, link,
                ):
                    migrations += int(moved > 0)
                    slots = new
                    keep = cross_node_copies(slots, E, G)
            elif step and stage2 == "predicted":
                # Stage 2: spare slots follow the predicted (averaged) load.
                slots = refresh_spares(slots, keep, stats.load_E, G, E)
            row = layer_metrics(topk_LTK[chunk], src_T[chunk], slots, E, N, G)
            if stage2 == "step":
                row["gpu_load_max_over_mean"] = max_over_mean(refilled_gpu_loads(topk_LTK[chunk], src_T[chunk],
                                                                                  slots, E, G))
            step_gpu.append(row["gpu_load_max_over_mean"])
            step_node.append(row["node_load_max_over_mean"])
            rows.append(row)
            stats.update(topk_LTK[chunk])
            window.append(chunk)
        per_layer.append(mean_metrics(rows))
        if progress is not None:
            progress(layer)
    return {"layers": per_layer, "mean": mean_metrics(per_layer), "replans": replans, "migrations": migrations,
            "stage2": stage2, "step_gpu_load_max_over_mean_median": float(np.median(step_gpu)),
            "step_node_load_max_over_mean_median": float(np.median(step_node))}


def step_tokens(src_T: np.ndarray, world_size: int, steps: int) -> list[np.ndarray]:
    """Token indices of each step: the s-th of `steps` equal consecutive chunks of every source rank's tokens."""
    per_rank = [np.nonzero(src_T == r)[0] for r in range(world_size)]
    cuts = [np.linspace(0, idx.size, steps + 1).astype(np.int64) for idx in per_rank]
    return [np.sort(np.concatenate([idx[c[s]:c[s + 1]] for idx, c in zip(per_rank, cuts)])) for s in range(steps)]


def refilled_gpu_loads(topk_TK: np.ndarray, source_rank_T: np.ndarray, slots_WS: np.ndarray, num_experts: int,
                       gpus_per_node: int) -> np.ndarray:
    """`[W]` rows each GPU serves in one step when every node refills its spare slots from this step's loads
    (`planner.stage2.refill_layout`, the runtime's rule). Sources choose nodes on `slots_WS` (`assign_tasks`)."""
    E, G, W = num_experts, gpus_per_node, slots_WS.shape[0]
    dest_TK, _ = assign_tasks(topk_TK, source_rank_T, slots_WS, G)
    valid = dest_TK >= 0
    load_NE = np.bincount((dest_TK[valid] // G) * E + topk_TK[valid], minlength=(W // G) * E).reshape(W // G, E)
    _, share_WS = refill_layout(slots_WS, load_NE, G, E)
    return share_WS.sum(1)
