"""The stage 1 objective: hypergraph connectivity of the tokens' top-k expert sets.

Legend: M distinct top-k sets, K top-k, E experts, N nodes, P pins (valid (set, expert) entries).

A token whose set touches lambda nodes is sent to lambda - 1 remote nodes when it lives on one of them
and lambda otherwise; with sources uniform over nodes (and independent of routing) the expected number
of remote nodes per token is lambda * (1 - 1/N). Minimising the weighted sum of (lambda - 1) over sets
(connectivity, "km1") therefore minimises expected cross-node tokens for any k; the pairwise
co-activation cut is exact only for k = 2.
"""

from __future__ import annotations

import numpy as np

__all__ = ["connectivity", "expected_remote_nodes", "PartitionState", "set_csr", "count_dtype"]


def connectivity(sets_MK: np.ndarray, count_M: np.ndarray, node_of_E: np.ndarray) -> float:
    """Sum over sets of count * (distinct nodes - 1) (sets with no valid id count 0)."""
    if sets_MK.shape[0] == 0:
        return 0.0
    node_MK = np.where(sets_MK >= 0, node_of_E[np.maximum(sets_MK, 0)], -1)
    node_MK = np.sort(node_MK, axis=1)
    new = np.ones(node_MK.shape, dtype=bool)
    new[:, 1:] = node_MK[:, 1:] != node_MK[:, :-1]
    lam_M = ((node_MK >= 0) & new).sum(axis=1)
    return float((count_M * np.maximum(lam_M - 1, 0)).sum())


def expected_remote_nodes(sets_MK: np.ndarray, count_M: np.ndarray, node_of_E: np.ndarray, nodes: int) -> float:
    """Expected distinct remote nodes per token (uniform sources, no replicas)."""
    total = float(count_M.sum())
    if total == 0:
        return 0.0
    lam = connectivity(sets_MK, count_M, node_of_E) + float(count_M[(sets_MK >= 0).any(axis=1)].sum())
    return lam * (1.0 - 1.0 / nodes) / total


def count_dtype(K: int) -> type:
    """Counter dtype for experts of one set per node: int8 when a set has < 128 entries (smaller arrays for
    the compiled loops that stream them), else int32."""
    return np.int8 if K < 128 else np.int32


def set_csr(sets_MK: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """`(ptr_E, set_P)` int64: CSR of the sets each expert belongs to (ascending set index, repeats kept)."""
    from . import _stage1_kernels as _kernels

    return _kernels.set_csr(np.ascontiguousarray(sets_MK, dtype=np.int64), int(num_experts))


class PartitionState:
    """Incremental connectivity of a partition: per-set node counts `cnt_MN` and exact move/swap deltas.

    The loops run compiled (`_stage1_kernels.part_*`); `ptr_E`/`set_P` is the CSR of each expert's sets.
    """

    def __init__(self, sets_MK: np.ndarray, count_M: np.ndarray, node_of_E: np.ndarray, nodes: int) -> None:
        self.E = int(node_of_E.size)
        self.N = int(nodes)
        self.M = int(sets_MK.shape[0])
        self.w_M = np.ascontiguousarray(count_M, dtype=np.float64)
        self.sets_MK = np.ascontiguousarray(sets_MK, dtype=np.int64)
        self.sets_K = int(sets_MK.shape[1]) if sets_MK.ndim == 2 else 0
        self.ptr_E, self.set_P = set_csr(self.sets_MK, self.E)
        self._reset(node_of_E)

    def _reset(self, node_of_E: np.ndarray) -> None:
        from . import _stage1_kernels as _kernels

        self.node_of_E = np.array(node_of_E, dtype=np.int64)
        self._mark = np.zeros(self.M, dtype=np.int8)
        cnt_MN = np.zeros((self.M, self.N), dtype=count_dtype(self.sets_K))
        self.cnt_MN = _kernels.part_counts(self.ptr_E, self.set_P, self.node_of_E, cnt_MN)

    def with_nodes(self, node_of_E: np.ndarray) -> "PartitionState":
        """A new state on the same sets (shares the read-only set structure) for another partition."""
        other = object.__new__(PartitionState)
        other.E, other.N, other.M, other.w_M, other.sets_MK, other.sets_K, other.ptr_E, other.set_P = (
            self.E, self.N, self.M, self.w_M, self.sets_MK, self.sets_K, self.ptr_E, self.set_P)
        other._reset(node_of_E)
        return other

    @property
    def sets_of_E(self) -> list[np.ndarray]:
        """Per expert, the (ascending) indices of the sets it is in."""
        return [self.set_P[self.ptr_E[e] : self.ptr_E[e + 1]] for e in range(self.E)]

    def value(self) -> float:
        """Connectivity sum count * (lambda - 1)."""
        lam_M = (self.cnt_MN > 0).sum(axis=1)
        return float((self.w_M * np.maximum(lam_M - 1, 0)).sum())

    def move_gains(self) -> np.ndarray:
        """`[E, N]` decrease of connectivity when moving expert e alone to node n (-inf at its own node)."""
        from . import _stage1_kernels as _kernels

        return _kernels.part_move_gains(self.sets_MK, self.cnt_MN, self.w_M, self.node_of_E)

    def swap_delta(self, a: int, b: int) -> float:
        """Decrease of connectivity when experts a and b exchange nodes (exact).

        Sets holding both experts keep their node counts; only sets with exactly one of them change.
        """
        from . import _stage1_kernels as _kernels

        return float(_kernels.part_swap_delta(self.ptr_E, self.set_P, self.cnt_MN, self.w_M, self.node_of_E,
                                              self._mark, int(a), int(b)))

    def swap_deltas(self, a_C: np.ndarray, b_C: np.ndarray) -> np.ndarray:
        """`[C]` float64 `swap_delta` of each pair (pairs sharing a and b's node in a row share work)."""
        from . import _stage1_kernels as _kernels

        return _kernels.part_swap_deltas(self.ptr_E, self.set_P, self.cnt_MN, self.w_M, self.node_of_E,
                                         self._mark, np.asarray(a_C, np.int64), np.asarray(b_C, np.int64))

    def try_swaps(self, a_C: np.ndarray, b_C: np.ndarray, load_E: np.ndarray, load_N: np.ndarray,
                  bound: float) -> bool:
        """Apply, in order, each pair with no expert touched before, node loads within `bound` after and
        `swap_delta > 1e-9`; `load_N` is updated in place. True if any was applied."""
        from . import _stage1_kernels as _kernels

        return bool(_kernels.part_try_swaps(self.ptr_E, self.set_P, self.cnt_MN, self.w_M, self.node_of_E,
                                            self._mark, np.asarray(a_C, np.int64), np.asarray(b_C, np.int64),
                                            load_E, load_N, float(bound)))

    def apply_swap(self, a: int, b: int) -> None:
        from . import _stage1_kernels as _kernels

        _kernels.part_apply_swap(self.ptr_E, self.set_P, self.cnt_MN, self.node_of_E, int(a), int(b))
