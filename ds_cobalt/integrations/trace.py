"""Record routing traces (DESIGN.md `.npz` format) from a training run.

Each ds_cobalt layer keeps the top-k ids of its forwards while recording; `save_trace` gathers every
rank's rows to rank 0 and writes `experts [L, T, K]`, `num_experts` and `source_rank [T]` (global ranks),
tokens ordered by forward, then rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..planner.trace import Trace
from ..planner.trace import save_trace as write_trace
from .layers import layer_cores


def start_trace(model: torch.nn.Module) -> None:
    """Start (or restart) recording the routing of every ds_cobalt layer of `model`."""
    for layer in layer_cores(model):
        layer.trace_rows = []


def stop_trace(model: torch.nn.Module) -> None:
    for layer in layer_cores(model):
        layer.trace_rows = None


def save_trace(model: torch.nn.Module, path: str | Path) -> Path | None:
    """Collective: gather the recorded routing to rank 0 and write it; returns the path on rank 0."""
    layers = layer_cores(model)
    if not layers or any(layer.trace_rows is None for layer in layers):
        raise RuntimeError("save_trace: no trace is recording; call start_trace (or set cobalt.trace) first")
    forwards = {len(layer.trace_rows) for layer in layers}
    if len(forwards) != 1:
        raise RuntimeError(f"save_trace: layers recorded different numbers of forwards {sorted(forwards)}")
    K = max(layer.top_k for layer in layers)
    per_forward = []  # [(L, T_f, K) ids] of this rank
    for step_rows in zip(*(layer.trace_rows for layer in layers)):
        T = step_rows[0].shape[0]
        block = np.full((len(layers), T, K), -1, dtype=np.int64)
        for l, rows in enumerate(step_rows):
            block[l, :, : rows.shape[1]] = rows.numpy()
        per_forward.append(block)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    gathered = [per_forward] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(gathered, per_forward)
    if rank != 0:
        return None
    blocks = [gathered[r][f] for f in range(len(per_forward)) for r in range(world)]
    sources = [np.full(gathered[r][f].shape[1], r, dtype=np.int64)
               for f in range(len(per_forward)) for r in range(world)]
    experts = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(layers), 0, K), dtype=np.int64)
    source = np.concatenate(sources) if sources else np.zeros(0, dtype=np.int64)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(Trace(experts, layers[0].num_experts, source), path)
    return path
