"""ds_cobalt: communication-aware expert parallelism for DeepSpeed MoE.

Torch/DeepSpeed-dependent names load lazily, so `ds_cobalt.planner` and `ds_cobalt.sim` stay
importable without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "MoE": "ds_cobalt.integrations.deepspeed_moe",
    "initialize": "ds_cobalt.integrations.engine",
    "traffic_summary": "ds_cobalt.integrations.layers",
    "schedule_summary": "ds_cobalt.integrations.layers",
    "balance_summary": "ds_cobalt.integrations.layers",
    "cobalt_layers": "ds_cobalt.integrations.layers",
    "logical_order": "ds_cobalt.integrations.checkpoint",
    "CobaltEngine": "ds_cobalt.integrations.cobalt_engine",
    "CobaltConfig": "ds_cobalt.config",
    "parse_cobalt_config": "ds_cobalt.config",
    "CobaltCallback": "ds_cobalt.integrations.hf",  # also `ds_cobalt.hf.CobaltCallback`
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_cobalt' has no attribute {name!r}")
