"""Routing statistics of one MoE layer: expert load, co-activation, top-k set histogram.

Legend: T tokens, K top-k, E experts, M distinct top-k sets.

- `load_E[e]`: number of (token, expert) pairs routed to e.
- `coact_EE[i, j]`: number of tokens choosing both i and j (i != j); symmetric, zero diagonal.
- `sets_MK`, `count_M`: the distinct top-k expert *sets* (each row sorted ascending, -1 padded at the end,
  duplicates inside a token removed) and how many tokens chose each. This is enough for the exact
  k > 2 objective (hypergraph connectivity), which `coact_EE` only approximates.

`count_routing` is the numpy reference for the runtime's on-device counting; `RoutingStats` keeps an
exponential moving average of all three (decay d: `stat <- d * stat + new`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["count_routing", "topk_sets", "merge_sets", "RoutingStats"]


def _check_topk(topk_ids_TK: np.ndarray, num_experts: int) -> np.ndarray:
    topk = np.asarray(topk_ids_TK)
    if topk.ndim != 2 or not np.issubdtype(topk.dtype, np.integer):
        raise ValueError(f"topk_ids_TK must be an integer array [T, K], got {topk.dtype} {topk.shape}")
    if topk.size and (int(topk.min()) < -1 or int(topk.max()) >= num_experts):
        raise ValueError(f"topk_ids_TK holds ids outside [0, num_experts={num_experts}) and not -1")
    return topk.astype(np.int64, copy=False)


def topk_sets(topk_ids_TK: np.ndarray) -> np.ndarray:
    """`[T, K]` int64: each token's expert set, sorted ascending, repeats and -1 moved to the end as -1."""
    topk = np.sort(np.asarray(topk_ids_TK, dtype=np.int64), axis=1)
    if topk.shape[1] > 1:
        repeat = np.zeros_like(topk, dtype=bool)
        repeat[:, 1:] = topk[:, 1:] == topk[:, :-1]
        topk = np.where(repeat, -1, topk)
    # Sort so that valid ids come first (ascending) and -1 pads the end.
    big = np.iinfo(np.int64).max
    keyed = np.sort(np.where(topk < 0, big, topk), axis=1)
    return np.where(keyed == big, -1, keyed)


def count_routing(topk_ids_TK: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference counts `(load_E, coact_EE)` (int64) of one layer's top-k ids `[T, K]` (-1 = dropped).

    A token listing an expert twice counts it once. Tokens with no valid id contribute nothing.
    """
    E = num_experts
    sets_TK = topk_sets(_check_topk(topk_ids_TK, E))
    valid = sets_TK >= 0
    load_E = np.bincount(sets_TK[valid], minlength=E).astype(np.int64)
    K = sets_TK.shape[1]
    coact_EE = np.zeros((E, E), dtype=np.int64)
    if K > 1 and sets_TK.shape[0]:
        i, j = np.triu_indices(K, 1)
        a, b = sets_TK[:, i].reshape(-1), sets_TK[:, j].reshape(-1)
        keep = (a >= 0) & (b >= 0)
        flat = np.bincount(a[keep] * E + b[keep], minlength=E * E).reshape(E, E)
        coact_EE = flat + flat.T
    return load_E, coact_EE


def merge_sets(
    sets_MK: np.ndarray, count_M: np.ndarray, max_sets: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Sum the counts of identical rows of `sets_MK`; keep the `max_sets` heaviest (ties: first row)."""
    if sets_MK.shape[0] == 0:
        return sets_MK.astype(np.int64), count_M.astype(np.float64)
    uniq_MK, inverse = np.unique(sets_MK, axis=0, return_inverse=True)
    counts = np.bincount(inverse.reshape(-1), weights=count_M, minlength=uniq_MK.shape[0])
    keep = counts > 0
    uniq_MK, counts = uniq_MK[keep], counts[keep]
    if max_sets is not None and uniq_MK.shape[0] > max_sets:
        top = np.sort(np.argsort(-counts, kind="stable")[:max_sets])
        uniq_MK, counts = uniq_MK[top], counts[top]
    return uniq_MK, counts


@dataclass
class RoutingStats:
    """Exponentially averaged statistics of one MoE layer (numpy; the runtime counts on device).

    `update(topk_ids_TK)` decays everything by `decay` and adds the new step's counts.
    `merge(other)` adds another accumulator's state (e.g. from another rank over the same steps).
    The set histogram keeps at most `max_sets` heaviest distinct sets.
    """

    num_experts: int
    top_k: int
    decay: float = 0.9
    max_sets: int = 1 << 16
    load_E: np.ndarray = field(default=None)  # type: ignore[assignment]  # [E] float64
    coact_EE: np.ndarray = field(default=None)  # type: ignore[assignment]  # [E, E] float64
    sets_MK: np.ndarray = field(default=None)  # type: ignore[assignment]  # [M, K] int64, -1 padded
    count_M: np.ndarray = field(default=None)  # type: ignore[assignment]  # [M] float64
    steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"RoutingStats: decay must be in [0, 1], got {self.decay}")
        E, K = self.num_experts, self.top_k
        if self.load_E is None:
            self.load_E = np.zeros(E)
        if self.coact_EE is None:
            self.coact_EE = np.zeros((E, E))
        if self.sets_MK is None:
            self.sets_MK = np.zeros((0, K), dtype=np.int64)
        if self.count_M is None:
            self.count_M = np.zeros(0)

    def update(self, topk_ids_TK: np.ndarray) -> None:
        """Decay the state and add one step's top-k ids `[T, K]` int (-1 = dropped)."""
        topk = _check_topk(topk_ids_TK, self.num_experts)
        if topk.shape[1] != self.top_k:
            raise ValueError(f"RoutingStats.update: expected K={self.top_k} columns, got {topk.shape[1]}")
        load_E, coact_EE = count_routing(topk, self.num_experts)
        sets_TK = topk_sets(topk)
        d = self.decay
        self.load_E = d * self.load_E + load_E
        self.coact_EE = d * self.coact_EE + coact_EE
        sets_TK = sets_TK[sets_TK[:, 0] >= 0]
        self.sets_MK, self.count_M = merge_sets(
            np.concatenate([self.sets_MK, sets_TK]),
            np.concatenate([d * self.count_M, np.ones(sets_TK.shape[0])]),
            self.max_sets,
        )
        self.steps += 1

    def merge(self, other: "RoutingStats") -> None:
        """Add another accumulator's statistics (same experts and K) into this one."""
        if (other.num_experts, other.top_k) != (self.num_experts, self.top_k):
            raise ValueError(
                f"RoutingStats.merge: shapes differ (E={other.num_experts}, K={other.top_k}) vs "
                f"(E={self.num_experts}, K={self.top_k})"
            )
        self.load_E = self.load_E + other.load_E
        self.coact_EE = self.coact_EE + other.coact_EE
        self.sets_MK, self.count_M = merge_sets(
            np.concatenate([self.sets_MK, other.sets_MK]),
            np.concatenate([self.count_M, other.count_M]),
            self.max_sets,
        )
        self.steps = max(self.steps, other.steps)

    @classmethod
    def from_topk(cls, topk_ids_TK: np.ndarray, num_experts: int, max_sets: int = 1 << 16) -> "RoutingStats":
        """Plain (undecayed) statistics of one batch of tokens."""
        stats = cls(num_experts, int(np.asarray(topk_ids_TK).shape[1]), decay=0.0, max_sets=max_sets)
        stats.update(topk_ids_TK)
        return stats
