"""Pure numpy planning: layouts, statistics, placement policies, task assignment (no torch import)."""

from .assign import assign_tasks, remote_nodes_per_token
from .layout import Layout, canonical_owner_order, contiguous_layout, layout_from_dict, load_layout, save_layout
from .migration import LinkModel, migration_worth_it
from .objective import connectivity, expected_remote_nodes
from .policies import POLICIES, LayerInput, plan_layer, plan_layout, register_policy
from .replicas import traffic_replicas
from .stage1 import plan_nodes
from .stage2 import plan_gpus
from .stats import RoutingStats, count_routing
from .trace import Trace, load_trace, save_trace, validate_trace

__all__ = [
    "Layout", "canonical_owner_order", "contiguous_layout", "layout_from_dict", "load_layout", "save_layout",
    "assign_tasks", "remote_nodes_per_token", "LinkModel", "migration_worth_it", "connectivity",
    "expected_remote_nodes", "POLICIES", "LayerInput", "plan_layer", "plan_layout", "register_policy",
    "plan_nodes", "plan_gpus", "RoutingStats", "count_routing", "Trace", "load_trace", "save_trace",
    "validate_trace", "traffic_replicas",
]
