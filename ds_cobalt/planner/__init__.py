"""Pure numpy planning: layouts, statistics, placement policies, task assignment (no torch import)."""

from .layout import Layout, canonical_owner_order, contiguous_layout, load_layout, save_layout

__all__ = ["Layout", "canonical_owner_order", "contiguous_layout", "load_layout", "save_layout"]
