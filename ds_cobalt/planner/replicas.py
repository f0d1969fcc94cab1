"""Cross-node replicas chosen for traffic: which non-owned experts each node should also hold.

Legend: T sample tokens, K top-k, E experts, N nodes.

A token on node s is sent to every remote node holding one of its experts that s does not hold (with
owners only, the owner nodes of those experts). A copy of expert e on s removes remote node m from the
token's destinations exactly when e is the token's only non-local expert owned by m. `traffic_replicas`
picks, node by node, the copies with the largest such saving on the sample tokens (greedy, recomputed
after each pick, so a pick that makes another expert "alone" on its node raises that expert's gain).

Tokens are weighted for node s by `1 + (N - 1) * [token lives on s]`: half of the weight is the node's own
tokens (routing may depend on where a token lives), half is all tokens (robust when s has few samples).
"""

from __future__ import annotations

import numpy as np

from .stats import topk_sets

__all__ = ["alone_gains", "traffic_replicas", "ReplicaPartitionState"]

OWN_TOKEN_BOOST = 1.0


def alone_gains(topk_ids_TK: np.ndarray, weight_T: np.ndarray, node_of_E: np.ndarray, holds_E: np.ndarray,
                num_experts: int) -> np.ndarray:
    """`[E]` float64 saving in remote nodes (weighted tokens) from one more copy of e on a node holding
    `holds_E` (bool); experts already held (or never chosen) gain 0.

    A pair (t, k) counts when e = topk[t, k] is not held and no other non-held expert of t has e's owner
    node (repeats of e inside a token count once).
    """
    return _alone_gains_sets(topk_sets(np.asarray(topk_ids_TK)), weight_T, node_of_E, holds_E, num_experts)


def _alone_gains_sets(sets_TK: np.ndarray, weight_T: np.ndarray, node_of_E: np.ndarray, holds_E: np.ndarray,
                      num_experts: int) -> np.ndarray:
    """`alone_gains` for rows without repeats (`topk_sets` output): O(T K) with a (token, node) count."""
    T = sets_TK.shape[0]
    N = int(node_of_E.max(initial=0)) + 1
    e_TK = np.maximum(sets_TK, 0)
    remote_TK = (sets_TK >= 0) & ~holds_E[e_TK]
    key_TK = np.arange(T)[:, None] * N + node_of_E[e_TK]
    cnt = np.bincount(key_TK[remote_TK], minlength=T * N)
    alone_TK = remote_TK & (cnt[key_TK] == 1)
    w_TK = np.broadcast_to(weight_T[:, None], sets_TK.shape)
    return np.bincount(e_TK[alone_TK], weights=w_TK[alone_TK], minlength=num_experts)


def traffic_replicas(
    topk_ids_TK: np.ndarray,
    source_node_T: np.ndarray,
    node_of_E: np.ndarray,
    holds_NE: np.ndarray,
    copies_per_node: int,
) -> np.ndarray:
    """`[N, E]` bool: up to `copies_per_node` extra experts per node, greedily by `alone_gains`.

    Args:
        topk_ids_TK: `[T, K]` int sample tokens, -1 = dropped.
        source_node_T: `[T]` int node where each token lives.
        node_of_E: `[E]` owner node per expert.
        holds_NE: `[N, E]` bool, what each node already holds (owners and copies chosen before).
        copies_per_node: how many copies each node may add.

    Only copies with a positive saving are added; the result never includes an expert a node holds.
    """
    N, E = holds_NE.shape
    extra_NE = np.zeros((N, E), dtype=bool)
    T = topk_ids_TK.shape[0]
    if T == 0 or N == 1 or copies_per_node <= 0:
        return extra_NE
    topk = topk_sets(np.asarray(topk_ids_TK, dtype=np.int64))
    src = np.asarray(source_node_T, dtype=np.int64)
    for n in range(N):
        weight_T = 1.0 + OWN_TOKEN_BOOST * (N - 1) * (src == n)
        held_E = holds_NE[n].copy()
        for _ in range(copies_per_node):
            gain_E = _alone_gains_sets(topk, weight_T, node_of_E, held_E, E)
            gain_E[held_E] = 0.0
            e = int(np.argmax(gain_E))
            if gain_E[e] <= 0:
                break
            held_E[e] = True
            extra_NE[n, e] = True
    return extra_NE


class ReplicaPartitionState:
    """Owner partition scored with fixed per-node copies: the expected remote nodes per token.

    View s (a token living on node s, each view weighted 1/N) ignores experts copied on s (they are local)
    and counts the nodes other than s touched by the rest of the set. Same interface as
    `objective.PartitionState` (`value`, `move_gains`, `swap_delta`, `apply_swap`), so `refine_swaps`
    works on it. `cnt_SMN[s, m, n]`: experts of set m owned by n that view s counts. Memory is
    N * M * N int32, so callers use it for small N only.
    """

    def __init__(self, sets_MK: np.ndarray, count_M: np.ndarray, node_of_E: np.ndarray, copies_NE: np.ndarray):
        from scipy import sparse

        self.N, self.E = copies_NE.shape
        self.node_of_E = np.asarray(node_of_E, dtype=np.int64).copy()
        self.active_SE = ~copies_NE
        m_P, k_P = np.nonzero(sets_MK >= 0)
        self.m_P, self.e_P = m_P, sets_MK[m_P, k_P].astype(np.int64)
        self.w_M = np.asarray(count_M, dtype=np.float64)
        M = sets_MK.shape[0]
        self.H_EM = sparse.csr_matrix((np.ones(self.e_P.size), (self.e_P, m_P)), shape=(self.E, M))
        self.sets_of_E = [self.H_EM.indices[self.H_EM.indptr[e] : self.H_EM.indptr[e + 1]] for e in range(self.E)]
        self.cnt_SMN = np.zeros((self.N, M, self.N), dtype=np.int32)
        for s in range(self.N):
            keep = self.active_SE[s, self.e_P]
            np.add.at(self.cnt_SMN[s], (m_P[keep], self.node_of_E[self.e_P[keep]]), 1)
        self._mark = np.zeros(M, dtype=np.int8)

    def value(self) -> float:
        """Sum over views and sets of count * (nodes other than s touched) / N."""
        total = 0.0
        for s in range(self.N):
            touched_M = (self.cnt_SMN[s] > 0).sum(axis=1) - (self.cnt_SMN[s, :, s] > 0)
            total += float((self.w_M * touched_M).sum())
        return total / self.N

    def move_gains(self) -> np.ndarray:
        """`[E, N]` decrease of `value` when moving expert e alone to node n (-inf at its own node)."""
        gain = np.zeros((self.E, self.N))
        for s in range(self.N):
            cnt = self.cnt_SMN[s]
            act_P = self.active_SE[s, self.e_P]
            own_P = self.node_of_E[self.e_P]
            alone_P = act_P & (cnt[self.m_P, own_P] == 1) & (own_P != s)
            leave_E = np.bincount(self.e_P, weights=self.w_M[self.m_P] * alone_P, minlength=self.E)
            absent_MN = (cnt == 0) * self.w_M[:, None]
            absent_MN[:, s] = 0.0
            enter_EN = np.asarray(self.H_EM @ absent_MN) * self.active_SE[s][:, None]
            gain += leave_E[:, None] - enter_EN
        gain /= self.N
        gain[np.arange(self.E), self.node_of_E] = -np.inf
        return gain

    def swap_delta(self, a: int, b: int) -> float:
        """Decrease of `value` when experts a and b exchange owner nodes (exact)."""
        A, B = int(self.node_of_E[a]), int(self.node_of_E[b])
        if A == B:
            return 0.0
        w, mark = self.w_M, self._mark
        total = 0.0
        for s in range(self.N):
            sa = self.sets_of_E[a] if self.active_SE[s, a] else self.sets_of_E[a][:0]
            sb = self.sets_of_E[b] if self.active_SE[s, b] else self.sets_of_E[b][:0]
            mark[sa] += 1
            mark[sb] += 2
            a_only, b_only = sa[mark[sa] == 1], sb[mark[sb] == 2]
            mark[sa] = 0
            mark[sb] = 0
            cnt_A, cnt_B = self.cnt_SMN[s, :, A], self.cnt_SMN[s, :, B]
            fa, fb = float(A != s), float(B != s)
            total += (w[a_only] * (fa * (cnt_A[a_only] == 1) - fb * (cnt_B[a_only] == 0))).sum()
            total += (w[b_only] * (fb * (cnt_B[b_only] == 1) - fa * (cnt_A[b_only] == 0))).sum()
        return float(total) / self.N

    def apply_swap(self, a: int, b: int) -> None:
        A, B = int(self.node_of_E[a]), int(self.node_of_E[b])
        for s in range(self.N):
            if self.active_SE[s, a]:
                self.cnt_SMN[s, self.sets_of_E[a], A] -= 1
                self.cnt_SMN[s, self.sets_of_E[a], B] += 1
            if self.active_SE[s, b]:
                self.cnt_SMN[s, self.sets_of_E[b], B] -= 1
                self.cnt_SMN[s, self.sets_of_E[b], A] += 1
        self.node_of_E[a], self.node_of_E[b] = B, A
