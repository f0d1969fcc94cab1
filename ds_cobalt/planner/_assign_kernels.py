"""Compiled loops of `assign.assign_tasks` and `assign.remote_nodes_per_token`.

Legend: T tokens, K top-k, E experts, N nodes, G GPUs per node, W ranks, F = N * E (node, expert) ids,
Q replicated groups.

Compiled with numba (`njit`: one thread, cached on disk next to this file, numpy error model), imported lazily
by assign.py so that importing the planner does not load numba. Each kernel is the loop its caller's docstring
specifies; simple references they must agree with are in tests/planner/test_fast_paths.py. Ties go to the
lowest index (first maximum / minimum, stable sorts), never to sort internals. With integer weights (token
counts) every float sum is exact, so results do not depend on summation order.
Numba's cache does not notice edits to jitted functions of another file: kernels here call only kernels
defined in this file.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernel_cache import ensure_built

_jit = njit(cache=True, nogil=True, error_model="numpy")  # numpy error model: no Python-style division checks


@_jit
def direct_counts(topk_TK, src_node_T, direct_NX):  # noqa: ANN001, ANN201
    """Steps 1-2 of `assign_tasks`, first pass over the pairs.

    `direct_NX[s, e]` (`[N, E + 1]`): the node serving e for a token on node s when it does not depend on the
    rest of the token's set, -1 = several remote holders (decided per token later), -3 = no holder;
    column E = dropped id (-2). Returns `pending_T` (rows with a -1), `count_F` (pairs per (node, expert) =
    node * E + e; pending pairs not counted) and whether some id is < -1, >= E or held by no node (the caller
    then raises the exact error).
    """
    T, K = topk_TK.shape
    N = direct_NX.shape[0]
    E = direct_NX.shape[1] - 1
    pending_T = np.zeros(T, dtype=np.bool_)
    count_F = np.zeros(N * E, dtype=np.int64)
    bad = False
    for t in range(T):
        row = direct_NX[src_node_T[t]]
        for k in range(K):
            e = topk_TK[t, k]
            if e < 0:
                bad |= e < -1
                continue
            v = row[e] if e < E else -3
            if v >= 0:
                count_F[v * E + e] += 1
            elif v == -1:
                pending_T[t] = True
            else:
                bad = True
    return pending_T, count_F, bad


@_jit
def pending_nodes(rows, topk_TK, src_node_T, direct_NX):  # noqa: ANN001, ANN201
    """`[P, K]` int64 step 1-2 nodes of the tokens `rows` (-2 dropped, -1 pending)."""
    K = topk_TK.shape[1]
    E = direct_NX.shape[1] - 1
    node_PK = np.empty((rows.size, K), dtype=np.int64)
    for p in range(rows.size):
        t = rows[p]
        row = direct_NX[src_node_T[t]]
        for k in range(K):
            e = topk_TK[t, k]
            node_PK[p, k] = row[E] if e < 0 else row[e]
    return node_PK


@_jit
def count_pending(rows, topk_TK, node_PK, src_node_T, direct_NX, count_F):  # noqa: ANN001, ANN201
    """Add to `count_F` the pairs of `rows` that steps 1-2 left pending (now decided in node_PK)."""
    K = topk_TK.shape[1]
    E = direct_NX.shape[1] - 1
    for p in range(rows.size):
        t = rows[p]
        row = direct_NX[src_node_T[t]]
        for k in range(K):
            e = topk_TK[t, k]
            if e >= 0 and row[e] == -1:
                count_F[node_PK[p, k] * E + e] += 1


@_jit
def _stable_order(key):  # noqa: ANN001, ANN202
    """Indices sorting `key` ascending, ties by index (insertion sort: for the few items of one node)."""
    n = key.size
    order = np.arange(n)
    for i in range(1, n):
        j = i
        cur = order[i]
        while j > 0 and key[order[j - 1]] > key[cur]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = cur
    return order


@_jit
def water_fill(load_R, amount):  # noqa: ANN001, ANN201
    """`[R]` int64 shares summing to `amount` that minimise max(load + share) (see assign._water_fill)."""
    R = load_R.size
    order = _stable_order(load_R)
    sorted_load = np.empty(R, dtype=np.int64)
    for i in range(R):
        sorted_load[i] = load_R[order[i]]
    # The largest prefix j whose filling to sorted_load[j - 1] costs at most `amount`.
    j = 0
    run = 0
    for i in range(R):
        run += sorted_load[i]
        if (i + 1) * sorted_load[i] - run <= amount:
            j = i + 1
        else:
            break
    total = amount
    for i in range(j):
        total += sorted_load[i]
    level = total // j
    extra = total - level * j
    share = np.zeros(R, dtype=np.int64)
    for i in range(j):
        share[order[i]] = level - sorted_load[i] + (1 if i < extra else 0)
    return share


@_jit
def choose_ranks(topk_TK, src_node_T, direct_NX, pending_T, node_PK, count_F, slot_of_WE, rank_NE,  # noqa: ANN001, ANN201
                 replicas_NE, G):
    """Step 5 of `assign_tasks`: `(dest_rank_TK, dest_slot_TK)`. The node of a pair is `direct_NX[source node,
    e]`, or for pending rows (`pending_T`, in order) their row of `node_PK`; node < 0 = dropped. `count_F`:
    pairs per (node, expert).

    Single-copy (node, expert) pairs go to their rank; replicated groups (at most N G R) are water-filled over
    their ranks, largest group first (ties: lower flat id), given the load placed so far; inside a group the
    pairs take the ranks in token order (first share[0] pairs to the first rank, ...).
    """
    T, K = topk_TK.shape
    W, E = slot_of_WE.shape
    N = W // G
    F = N * E
    rank_flat = rank_NE.reshape(-1)
    multi_F = replicas_NE.reshape(-1) > 1
    load_W = np.zeros(W, dtype=np.int64)
    n_groups = 0
    for f in range(F):
        if multi_F[f]:
            if count_F[f] > 0:
                n_groups += 1
        else:
            load_W[rank_flat[f]] += count_F[f]
    # Replicated groups: LPT order (count descending, flat id ascending), water-filled over their ranks.
    groups = np.empty(n_groups, dtype=np.int64)
    i = 0
    for f in range(F):
        if multi_F[f] and count_F[f] > 0:
            groups[i] = f
            i += 1
    key = np.empty(n_groups, dtype=np.int64)
    for i in range(n_groups):
        key[i] = -count_F[groups[i]] * (F + 1) + groups[i]
    order = np.argsort(key)  # keys are distinct: any sort is the stable one
    gid_F = np.full(F, -1, dtype=np.int64)
    ranks_QG = np.full((n_groups, G), -1, dtype=np.int64)
    share_QG = np.zeros((n_groups, G), dtype=np.int64)
    for q in range(n_groups):
        gid_F[groups[q]] = q
    for o in range(n_groups):
        q = order[o]
        f = groups[q]
        n = f // E
        e = f - n * E
        r = 0
        for g in range(G):
            if slot_of_WE[n * G + g, e] >= 0:
                ranks_QG[q, r] = n * G + g
                r += 1
        load_R = np.empty(r, dtype=np.int64)
        for j in range(r):
            load_R[j] = load_W[ranks_QG[q, j]]
        share = water_fill(load_R, count_F[f])
        for j in range(r):
            share_QG[q, j] = share[j]
            load_W[ranks_QG[q, j]] += share[j]
    # Output pass, token order: every (node, expert) id has a current rank and how many pairs it still takes
    # (single-copy ids: all of theirs); a replicated group moves to its next rank (skipping zero shares) when
    # the current one is full.
    cur_F = rank_flat.copy()
    left_F = count_F.copy()
    cursor_Q = np.zeros(n_groups, dtype=np.int64)
    for q in range(n_groups):
        f = groups[q]
        j = 0
        while share_QG[q, j] == 0:
            j += 1
        cursor_Q[q] = j
        cur_F[f] = ranks_QG[q, j]
        left_F[f] = share_QG[q, j]
    slot_flat = slot_of_WE.reshape(-1)
    rank_TK = np.empty((T, K), dtype=np.int64)
    slot_TK = np.empty((T, K), dtype=np.int64)
    Ed = direct_NX.shape[1] - 1
    p = 0
    for t in range(T):
        direct = pending_T[t]  # (a pending row: nodes from node_PK)
        row = direct_NX[src_node_T[t]]
        for k in range(K):
            e = topk_TK[t, k]
            if direct:
                n = node_PK[p, k]
            else:
                n = row[Ed] if e < 0 else row[e]
            if n < 0:
                rank_TK[t, k] = -1
                slot_TK[t, k] = -1
                continue
            f = n * E + e
            if left_F[f] == 0:
                q = gid_F[f]
                j = cursor_Q[q] + 1
                while share_QG[q, j] == 0:
                    j += 1
                cursor_Q[q] = j
                cur_F[f] = ranks_QG[q, j]
                left_F[f] = share_QG[q, j]
            r = cur_F[f]
            left_F[f] -= 1
            rank_TK[t, k] = r
            slot_TK[t, k] = slot_flat[r * E + e]
        p += direct
    return rank_TK, slot_TK


@_jit
def remote_nodes(dest_rank_TK, source_rank_T, G):  # noqa: ANN001, ANN201
    """`[T]` int64 distinct remote nodes per token (see assign.remote_nodes_per_token); a bit set of nodes
    per token (nodes >= 64: compared one by one)."""
    T, K = dest_rank_TK.shape
    out = np.zeros(T, dtype=np.int64)
    one = np.uint64(1)
    for t in range(T):
        s = source_rank_T[t] // G
        seen = np.uint64(0)
        c = 0
        for k in range(K):
            r = dest_rank_TK[t, k]
            if r < 0:
                continue
            n = r // G
            if n == s:
                continue
            if n < 64:
                seen |= one << np.uint64(n)
            else:
                first = True
                for j in range(k):
                    rj = dest_rank_TK[t, j]
                    if rj >= 0 and rj // G == n:
                        first = False
                        break
                c += first
        while seen:
            seen &= seen - one
            c += 1
        out[t] = c
    return out


@_jit
def cover_rows(rows, topk_TK, node_PK, holds_NE, src_node_T):  # noqa: ANN001, ANN201
    """Steps 3-4 of `assign_tasks` for the tokens `rows` (those with pairs node_PK == -1: experts held by
    several remote nodes), in place on their rows `node_PK`. Step 3: a pending expert held by a node the token already
    visits (remote) goes there (largest tie-break among them). Step 4: greedy set cover, each round the node
    covering most pending experts (+ tie-break). Tie-break of token t at node n: 0.5 ((n - 7919 t) mod N) / N.
    Returns `(new_nodes_P, before_PK)`: new nodes opened by step 4, pending pairs before it (for the exact
    search of step 4b)."""
    P = rows.size
    K = topk_TK.shape[1]
    N = holds_NE.shape[0]
    new_nodes = np.zeros(P, dtype=np.int64)
    before = np.zeros((P, K), dtype=np.bool_)
    visited = np.zeros(N, dtype=np.bool_)
    tie = np.empty(N)
    pend = np.zeros(K, dtype=np.bool_)
    cover = np.zeros((K, N), dtype=np.bool_)
    for p in range(P):
        t = rows[p]
        for n in range(N):
            tie[n] = 0.5 * ((n - t * 7919) % N) / N
            visited[n] = False
        for k in range(K):
            v = node_PK[p, k]
            if v >= 0:
                visited[v] = True
        visited[src_node_T[t]] = False
        # Step 3: nodes already visited.
        for k in range(K):
            pend[k] = node_PK[p, k] == -1
            if not pend[k]:
                continue
            e = topk_TK[t, k]
            best = -1
            best_v = 0.0
            for n in range(N):
                cover[k, n] = holds_NE[n, e]
                v = (1.0 if (cover[k, n] and visited[n]) else 0.0) + tie[n]
                if best < 0 or v > best_v:
                    best = n
                    best_v = v
            if best_v >= 1.0:  # some visited node holds e
                node_PK[p, k] = best
                pend[k] = False
        # Step 4: greedy cover with new nodes.
        for k in range(K):
            before[p, k] = pend[k]
        while True:
            left = False
            for k in range(K):
                left |= pend[k]
            if not left:
                break
            best = -1
            best_v = 0.0
            for n in range(N):
                c = 0
                for k in range(K):
                    c += pend[k] and cover[k, n]
                v = c + tie[n]
                if best < 0 or v > best_v:
                    best = n
                    best_v = v
            for k in range(K):
                if pend[k] and cover[k, best]:
                    node_PK[p, k] = best
                    pend[k] = False
            new_nodes[p] += 1
    return new_nodes, before


ensure_built(direct_counts)  # the cache is compiled whole by one process (kernel_cache)
