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

__all__ = ["alone_gains", "traffic_replicas", "traffic_order", "ReplicaPartitionState"]

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
    return traffic_order(topk_ids_TK, source_node_T, node_of_E, holds_NE, copies_per_node) < copies_per_node


def traffic_order(
    topk_ids_TK: np.ndarray,
    source_node_T: np.ndarray,
    node_of_E: np.ndarray,
    holds_NE: np.ndarray,
    count: int,
) -> np.ndarray:
    """`[N, E]` int64: the order in which `traffic_replicas` picks each node's copies (int64 max = not picked
    within `count`); `traffic_replicas(..., y)` is `traffic_order(..., count) < y` for every y <= count.

    Per node n, each step adds the first expert with the largest `alone_gains` (tokens weighted
    `1 + (N - 1) [token lives on n]`) given what n holds so far, while that gain is positive. Compiled
    (`_replica_kernels.greedy_copies`); the gains are updated exactly after each pick for the tokens containing it.
    """
    N, E = holds_NE.shape
    T = topk_ids_TK.shape[0]
    if T == 0 or N == 1 or count <= 0:
        return np.full((N, E), np.iinfo(np.int64).max, dtype=np.int64)
    return _traffic_order_sets(topk_sets(np.asarray(topk_ids_TK, dtype=np.int64)), source_node_T, node_of_E,
                               holds_NE, count)


def _traffic_order_sets(sets_TK: np.ndarray, source_node_T: np.ndarray, node_of_E: np.ndarray,
                        holds_NE: np.ndarray, count: int) -> np.ndarray:
    """`traffic_order` on the tokens' `topk_sets` rows (computed once by callers that repeat it)."""
    from . import _replica_kernels as _kernels

    N, E = holds_NE.shape
    if sets_TK.shape[0] == 0 or N == 1 or count <= 0:
        return np.full((N, E), np.iinfo(np.int64).max, dtype=np.int64)
    topk = np.ascontiguousarray(sets_TK, dtype=np.int64)
    src = np.asarray(source_node_T, dtype=np.int64)
    own_weight = float(1.0 + OWN_TOKEN_BOOST * (N - 1))
    return _kernels.greedy_copies(topk, src, np.asarray(node_of_E, dtype=np.int64),
                                  np.ascontiguousarray(holds_NE, dtype=bool), int(count), own_weight)


class ReplicaPartitionState:
    """Owner partition scored with fixed per-node copies: the expected remote nodes per token.

    View s (a token living on node s, each view weighted 1/N) ignores experts copied on s (they are local)
    and counts the nodes other than s touched by the rest of the set. Same interface as
    `objective.PartitionState` (`value`, `move_gains`, `swap_delta`, `apply_swap`, plus the batch
    `swap_deltas`/`try_swaps`), so `refine_swaps` works on it. `cnt_MSN[m, s, n]`: experts of set m owned by
    n that view s counts. Memory is M * N * N int8, so callers use it for small N only. Loops compiled
    (`_replica_kernels.rep_*`).
    """

    def __init__(self, sets_MK: np.ndarray, count_M: np.ndarray, node_of_E: np.ndarray, copies_NE: np.ndarray):
        from . import _replica_kernels as _kernels
        from .objective import count_dtype, set_csr

        self.N, self.E = copies_NE.shape
        self.node_of_E = np.array(node_of_E, dtype=np.int64)
        self.active_SE = np.ascontiguousarray(~np.asarray(copies_NE, dtype=bool))
        self.w_M = np.ascontiguousarray(count_M, dtype=np.float64)
        self.M = int(sets_MK.shape[0])
        self.sets_MK = np.ascontiguousarray(sets_MK, dtype=np.int64)
        self.ptr_E, self.set_P = set_csr(self.sets_MK, self.E)
        cnt = np.zeros((self.M, self.N, self.N), dtype=count_dtype(self.sets_MK.shape[1]))
        self.cnt_MSN = _kernels.rep_counts(self.sets_MK, self.node_of_E, self.active_SE, cnt)
        self._mark = np.zeros(self.M, dtype=np.int8)

    def value(self) -> float:
        """Sum over views and sets of count * (nodes other than s touched) / N."""
        from . import _replica_kernels as _kernels

        return float(_kernels.rep_value(self.cnt_MSN, self.w_M))

    def move_gains(self) -> np.ndarray:
        """`[E, N]` decrease of `value` when moving expert e alone to node n (-inf at its own node)."""
        from . import _replica_kernels as _kernels

        return _kernels.rep_move_gains(self.sets_MK, self.cnt_MSN, self.w_M, self.node_of_E, self.active_SE)

    def swap_delta(self, a: int, b: int) -> float:
        """Decrease of `value` when experts a and b exchange owner nodes (exact)."""
        from . import _replica_kernels as _kernels

        return float(_kernels.rep_swap_delta(self.ptr_E, self.set_P, self.cnt_MSN, self.w_M, self.node_of_E,
                                             self.active_SE, self._mark, int(a), int(b)))

    def swap_deltas(self, a_C: np.ndarray, b_C: np.ndarray) -> np.ndarray:
        """`[C]` float64 `swap_delta` of each pair."""
        from . import _replica_kernels as _kernels

        return _kernels.rep_swap_deltas(self.ptr_E, self.set_P, self.cnt_MSN, self.w_M, self.node_of_E,
                                        self.active_SE, self._mark, np.asarray(a_C, np.int64),
                                        np.asarray(b_C, np.int64))

    def try_swaps(self, a_C: np.ndarray, b_C: np.ndarray, load_E: np.ndarray, load_N: np.ndarray,
                  bound: float) -> bool:
        """As `PartitionState.try_swaps`."""
        from . import _replica_kernels as _kernels

        return bool(_kernels.rep_try_swaps(self.ptr_E, self.set_P, self.cnt_MSN, self.w_M, self.node_of_E,
                                           self.active_SE, self._mark, np.asarray(a_C, np.int64),
                                           np.asarray(b_C, np.int64), load_E, load_N, float(bound)))

    def apply_swap(self, a: int, b: int) -> None:
        from . import _replica_kernels as _kernels

        _kernels.rep_apply_swap(self.ptr_E, self.set_P, self.cnt_MSN, self.node_of_E, self.active_SE, int(a), int(b))

    def copies_NE(self) -> np.ndarray:
        """`[N, E]` bool: the copies held off the owner node (a copy on the owner's node counts for nothing)."""
        return ~self.active_SE & (self.node_of_E[None, :] != np.arange(self.N)[:, None])

    def copy_gains(self, s: int) -> np.ndarray:
        """`[E]` decrease of `value` when node s toggles its copy of e: adding it where s has none (>= 0),
        dropping it where s has one (<= 0); 0 where s owns e."""
        from . import _replica_kernels as _kernels

        return _kernels.rep_copy_gains(self.ptr_E, self.set_P, self.cnt_MSN, self.w_M, self.node_of_E,
                                       self.active_SE, int(s))

    def copy_gain(self, s: int, e: int) -> float:
        """One entry of `copy_gains`."""
        from . import _replica_kernels as _kernels

        return float(_kernels.rep_copy_gain(self.ptr_E, self.set_P, self.cnt_MSN, self.w_M, self.node_of_E,
                                            self.active_SE, int(s), int(e)))

    def copy_move_delta(self, s: int, e: int, f: int) -> float:
        """Decrease of `value` when node s drops its copy of e and takes one of f (exact, state unchanged)."""
        from . import _replica_kernels as _kernels

        return float(_kernels.rep_copy_move_delta(self.ptr_E, self.set_P, self.cnt_MSN, self.w_M, self.node_of_E,
                                                  self.active_SE, int(s), int(e), int(f)))

    def toggle_copy(self, s: int, e: int) -> None:
        """Add node s's copy of e if it has none, else drop it."""
        from . import _replica_kernels as _kernels

        _kernels.rep_toggle_copy(self.ptr_E, self.set_P, self.cnt_MSN, self.node_of_E, self.active_SE, int(s), int(e))
