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
from scipy import sparse

__all__ = ["connectivity", "expected_remote_nodes", "PartitionState"]


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


class PartitionState:
    """Incremental connectivity of a partition: per-set node counts `cnt_MN` and exact move/swap deltas."""

    def __init__(self, sets_MK: np.ndarray, count_M: np.ndarray, node_of_E: np.ndarray, nodes: int) -> None:
        self.E = int(node_of_E.size)
        self.N = int(nodes)
        m_P, k_P = np.nonzero(sets_MK >= 0)
        self.m_P = m_P
        self.e_P = sets_MK[m_P, k_P].astype(np.int64)
        self.w_M = np.asarray(count_M, dtype=np.float64)
        M = sets_MK.shape[0]
        # H_EM: incidence, expert x set (CSR rows = the sets each expert is in).
        self.H_EM = sparse.csr_matrix((np.ones(self.e_P.size), (self.e_P, m_P)), shape=(self.E, M))
        self.sets_of_E = [self.H_EM.indices[self.H_EM.indptr[e] : self.H_EM.indptr[e + 1]] for e in range(self.E)]
        self.node_of_E = np.asarray(node_of_E, dtype=np.int64).copy()
        self._mark = np.zeros(M, dtype=np.int8)
        self.cnt_MN = np.zeros((M, self.N), dtype=np.int32)
        np.add.at(self.cnt_MN, (m_P, self.node_of_E[self.e_P]), 1)

    def value(self) -> float:
        """Connectivity sum count * (lambda - 1)."""
        lam_M = (self.cnt_MN > 0).sum(axis=1)
        return float((self.w_M * np.maximum(lam_M - 1, 0)).sum())

    def move_gains(self) -> np.ndarray:
        """`[E, N]` decrease of connectivity when moving expert e alone to node n (-inf at its own node)."""
        alone_P = self.cnt_MN[self.m_P, self.node_of_E[self.e_P]] == 1
        leave_E = np.bincount(self.e_P, weights=self.w_M[self.m_P] * alone_P, minlength=self.E)
        absent_MN = (self.cnt_MN == 0) * self.w_M[:, None]
        enter_EN = np.asarray(self.H_EM @ absent_MN)
        gain = leave_E[:, None] - enter_EN
        gain[np.arange(self.E), self.node_of_E] = -np.inf
        return gain

    def swap_delta(self, a: int, b: int) -> float:
        """Decrease of connectivity when experts a and b exchange nodes (exact)."""
        A, B = self.node_of_E[a], self.node_of_E[b]
        if A == B:
            return 0.0
        sa, sb = self.sets_of_E[a], self.sets_of_E[b]
        # Sets holding both experts keep their node counts; only sets with exactly one of them change.
        mark = self._mark
        mark[sa] += 1
        mark[sb] += 2
        a_only, b_only = sa[mark[sa] == 1], sb[mark[sb] == 2]
        mark[sa] = 0
        mark[sb] = 0
        cnt_A, cnt_B, w = self.cnt_MN[:, A], self.cnt_MN[:, B], self.w_M
        gain = (w[a_only] * ((cnt_A[a_only] == 1).astype(np.int8) - (cnt_B[a_only] == 0))).sum()
        gain += (w[b_only] * ((cnt_B[b_only] == 1).astype(np.int8) - (cnt_A[b_only] == 0))).sum()
        return float(gain)

    def apply_swap(self, a: int, b: int) -> None:
        A, B = self.node_of_E[a], self.node_of_E[b]
        sa, sb = self.sets_of_E[a], self.sets_of_E[b]
        self.cnt_MN[sa, A] -= 1
        self.cnt_MN[sa, B] += 1
        self.cnt_MN[sb, B] -= 1
        self.cnt_MN[sb, A] += 1
        self.node_of_E[a], self.node_of_E[b] = B, A
