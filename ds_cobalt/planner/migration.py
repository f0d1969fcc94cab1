"""Migration cost model: is moving expert owners worth it over the next replan interval?

Legend: E experts. Bytes moved = experts changing owner node x (weights + optimizer state) bytes each;
bytes saved = (old - new) cross-node tokens per token x tokens per step x bytes per token crossing x
4 (dispatch + combine, forward + backward) x steps in the interval. Both are divided by the inter-node
bandwidth; migrate when the saved time exceeds `margin` x the migration time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LinkModel", "copy_cost_per_token", "moved_experts", "migration_bytes", "migration_worth_it"]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Sizes and bandwidth used by the cost model (defaults: bf16 weights, fp32 master + Adam moments)."""

    expert_params: int = 3 * 4096 * 1408
    weight_bytes_per_param: int = 2
    optimizer_bytes_per_param: int = 12
    token_bytes: int = 2 * 4096
    inter_node_gbps: float = 50.0
    margin: float = 1.5

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * (self.weight_bytes_per_param + self.optimizer_bytes_per_param)

    @property
    def bytes_per_s(self) -> float:
        return self.inter_node_gbps * 1e9 / 8


def copy_cost_per_token(link: LinkModel, tokens_per_step: float) -> float:
    """What one traffic copy (a replica held on another node than its owner) costs per step, in cross-node tokens
    per token: its weights cross in forward and their gradients in backward (2 x weight bytes), against 4 x
    `token_bytes` per cross-node token (dispatch + combine, forward + backward). For a two-matrix expert of hidden
    size D and width F at equal weight and activation sizes, about F tokens a step."""
    if tokens_per_step <= 0:
        return 0.0
    return 2.0 * link.expert_params * link.weight_bytes_per_param / (4.0 * link.token_bytes) / tokens_per_step


def moved_experts(old_node_of_E: np.ndarray, new_node_of_E: np.ndarray) -> int:
    """Number of experts whose owner node changes."""
    return int((np.asarray(old_node_of_E) != np.asarray(new_node_of_E)).sum())


def migration_bytes(moved: int, old_cross_per_token: float, new_cross_per_token: float, tokens_per_step: float,
                    interval_steps: int, link: LinkModel = LinkModel()) -> tuple[float, float]:
    """`(saved, cost)` bytes over `interval_steps`: cross-node bytes the new layout saves (dispatch + combine,
    forward + backward) and the bytes that moving `moved` experts with their optimizer state costs."""
    saved = (old_cross_per_token - new_cross_per_token) * tokens_per_step * link.token_bytes * 4 * interval_steps
    return saved, float(moved * link.expert_bytes)


def migration_worth_it(
    moved: int,
    old_cross_per_token: float,
    new_cross_per_token: float,
    tokens_per_step: int,
    interval_steps: int,
    link: LinkModel = LinkModel(),
) -> bool:
    """True when the modelled saving over `interval_steps` beats `margin` x the migration cost."""
    if moved == 0:
        return False
    saved_bytes, cost_bytes = migration_bytes(moved, old_cross_per_token, new_cross_per_token, tokens_per_step,
                                              interval_steps, link)
    return saved_bytes > link.margin * cost_bytes
