"""Compiled loops of `replicas.py`: the replica-aware objective and greedy traffic copies.

Legend: M sets, K top-k, E experts, N nodes (S = source views, one per node), T tokens, C candidate pairs.
`cnt_MSN[m, s, n]`: experts of set m owned by n that view s counts (those not copied on s).

Compiled with numba (`njit`: one thread, cached on disk next to this file, numpy error model), imported lazily
by replicas.py so that importing the planner does not load numba. Each kernel is the loop its caller's
docstring specifies; simple references they must agree with are in tests/planner/test_fast_paths.py. Ties go
to the lowest index (first maximum / minimum, stable sorts), never to sort internals. With integer weights
(token counts) every float sum is exact, so results do not depend on summation order.
Numba's cache does not notice edits to jitted functions of another file: kernels here call only kernels
defined in this file.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernel_cache import ensure_built

_jit = njit(cache=True, nogil=True, error_model="numpy")  # numpy error model: no Python-style division checks


@_jit
def _ind(flag):  # noqa: ANN001, ANN202
    return 1.0 if flag else 0.0


@_jit
def rep_counts(sets_MK, node_of_E, active_SE, cnt):  # noqa: ANN001, ANN201
    """Fill `cnt` (`[M, N, N]`, zeros; int8 when K < 128) with the per-view counts."""
    M, K = sets_MK.shape
    N = active_SE.shape[0]
    for m in range(M):
        for k in range(K):
            e = sets_MK[m, k]
            if e < 0:
                continue
            n = node_of_E[e]
            for s in range(N):
                if active_SE[s, e]:
                    cnt[m, s, n] += 1
    return cnt


@_jit
def rep_value(cnt_MSN, w_M):  # noqa: ANN001, ANN201
    """Sum over views s (outer) and sets of count * (nodes other than s touched), divided by N."""
    M, N, _ = cnt_MSN.shape
    total = 0.0
    for s in range(N):
        part = 0.0
        for m in range(M):
            touched = 0
            for n in range(N):
                if n != s and cnt_MSN[m, s, n] > 0:
                    touched += 1
            part += w_M[m] * touched
        total += part
    return total / N


@_jit
def rep_move_gains(sets_MK, cnt_MSN, w_M, node_of_E, active_SE):  # noqa: ANN001, ANN201
    """`[E, N]` decrease of the replica-aware value when e moves alone to n (-inf at its own node):
    (1/N) sum over views s where e counts of leave_s(e) - enter_s(e, n), with
    leave_s(e) = sum_{m in e} w_m [own != s][cnt_s(m, own) == 1], enter_s(e, n) = sum_{m in e} w_m [n != s]
    [cnt_s(m, n) == 0]. Set-major: per set, the sums over all views (`L_N`, `Z_N`) go to each of its
    experts; an expert not counted in some views has those views' terms taken out (or, when it is counted in
    fewer than half, its counted views summed directly). Exact for integer weights (token counts)."""
    M, K = sets_MK.shape
    N = active_SE.shape[0]
    E = node_of_E.size
    inactive_E = np.zeros(E, dtype=np.int64)
    for s in range(N):
        for e in range(E):
            inactive_E[e] += not active_SE[s, e]
    leave = np.zeros(E)
    enter = np.zeros((E, N))
    L_N = np.empty(N)
    Z_N = np.empty(N)
    for m in range(M):
        w = w_M[m]
        block = cnt_MSN[m]
        L_N[:] = 0.0
        Z_N[:] = 0.0
        for s in range(N):
            for n in range(N):  # branch-free: these flags are unpredictable
                c = block[s, n]
                f = 0.0 if n == s else w
                Z_N[n] += f * (c == 0)
                L_N[n] += f * (c == 1)
        for k in range(K):
            e = sets_MK[m, k]
            if e < 0:
                continue
            own = node_of_E[e]
            if inactive_E[e] == 0:
                leave[e] += L_N[own]
                for n in range(N):
                    enter[e, n] += Z_N[n]
            elif 2 * inactive_E[e] > N:
                # Counted in few views (a copy on most nodes): those views directly.
                for s in range(N):
                    if active_SE[s, e]:
                        if own != s:
                            leave[e] += w * (block[s, own] == 1)
                        for n in range(N):
                            if n != s:
                                enter[e, n] += w * (block[s, n] == 0)
            else:
                back = L_N[own]
                for n in range(N):
                    enter[e, n] += Z_N[n]
                for s in range(N):
                    if not active_SE[s, e]:
                        # View s does not count e: take its terms back out.
                        if own != s:
                            back -= w * (block[s, own] == 1)
                        for n in range(N):
                            if n != s:
                                enter[e, n] -= w * (block[s, n] == 0)
                leave[e] += back
    gain = np.empty((E, N))
    for e in range(E):
        for n in range(N):
            gain[e, n] = (leave[e] - enter[e, n]) / N
        gain[e, node_of_E[e]] = -np.inf
    return gain


@_jit
def _rep_delta(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, part_S, a, b):  # noqa: ANN001, ANN202
    """Exact decrease of the replica-aware value when a and b exchange owners. Per view s the sets the view
    counts that hold exactly one of the two change: with both counted, the sets of one and not the other;
    with one counted, all of its sets. Views are summed in order (`part_S` scratch); `mark_M` is zero on
    entry and exit."""
    A = node_of_E[a]
    B = node_of_E[b]
    if A == B:
        return 0.0
    N = active_SE.shape[0]
    for p in range(ptr_E[a], ptr_E[a + 1]):
        mark_M[set_P[p]] += 1
    for p in range(ptr_E[b], ptr_E[b + 1]):
        mark_M[set_P[p]] += 2
    part_S[:] = 0.0
    for p in range(ptr_E[a], ptr_E[a + 1]):
        m = set_P[p]
        w = w_M[m]
        only = mark_M[m] == 1
        block = cnt_MSN[m]
        for s in range(N):
            if active_SE[s, a] and (only or not active_SE[s, b]):
                fa = 1.0 if A != s else 0.0
                fb = 1.0 if B != s else 0.0
                part_S[s] += w * (fa * _ind(block[s, A] == 1) - fb * _ind(block[s, B] == 0))
    for p in range(ptr_E[b], ptr_E[b + 1]):
        m = set_P[p]
        w = w_M[m]
        only = mark_M[m] == 2
        block = cnt_MSN[m]
        for s in range(N):
            if active_SE[s, b] and (only or not active_SE[s, a]):
                fa = 1.0 if A != s else 0.0
                fb = 1.0 if B != s else 0.0
                part_S[s] += w * (fb * _ind(block[s, B] == 1) - fa * _ind(block[s, A] == 0))
    for p in range(ptr_E[a], ptr_E[a + 1]):
        mark_M[set_P[p]] = 0
    for p in range(ptr_E[b], ptr_E[b + 1]):
        mark_M[set_P[p]] = 0
    total = 0.0
    for s in range(N):
        total += part_S[s]
    return total / N


@_jit
def rep_swap_delta(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, a, b):  # noqa: ANN001, ANN201
    part_S = np.empty(active_SE.shape[0])
    return _rep_delta(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, part_S, a, b)


@_jit
def rep_swap_deltas(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, a_C, b_C):  # noqa: ANN001, ANN201
    out = np.empty(a_C.size)
    part_S = np.empty(active_SE.shape[0])
    for c in range(a_C.size):
        out[c] = _rep_delta(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, part_S, a_C[c], b_C[c])
    return out


@_jit
def _rep_apply(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, a, b):  # noqa: ANN001, ANN202
    A = node_of_E[a]
    B = node_of_E[b]
    N = active_SE.shape[0]
    for p in range(ptr_E[a], ptr_E[a + 1]):
        m = set_P[p]
        for s in range(N):
            if active_SE[s, a]:
                cnt_MSN[m, s, A] -= 1
                cnt_MSN[m, s, B] += 1
    for p in range(ptr_E[b], ptr_E[b + 1]):
        m = set_P[p]
        for s in range(N):
            if active_SE[s, b]:
                cnt_MSN[m, s, B] -= 1
                cnt_MSN[m, s, A] += 1
    node_of_E[a] = B
    node_of_E[b] = A


@_jit
def rep_apply_swap(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, a, b):  # noqa: ANN001, ANN201
    _rep_apply(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, a, b)


@_jit
def rep_try_swaps(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, a_C, b_C,  # noqa: ANN001, ANN201
                  load_E, load_N, bound):
    """As `_stage1_kernels.part_try_swaps`, on the replica-aware objective."""
    touched = np.zeros(node_of_E.size, dtype=np.bool_)
    part_S = np.empty(active_SE.shape[0])
    improved = False
    for c in range(a_C.size):
        a = a_C[c]
        b = b_C[c]
        if touched[a] or touched[b]:
            continue
        A = node_of_E[a]
        B = node_of_E[b]
        dA = load_E[b] - load_E[a]
        if max(load_N[A] + dA, load_N[B] - dA) > bound + 1e-9:
            continue
        if _rep_delta(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, mark_M, part_S, a, b) > 1e-9:
            _rep_apply(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, a, b)
            load_N[A] += dA
            load_N[B] -= dA
            touched[a] = True
            touched[b] = True
            improved = True
    return improved


@_jit
def _grouped_alone(e_TK, g_TK, t, held_E, weight, gain_E):  # noqa: ANN001, ANN202
    """Add `weight` to gain_E[e] for each expert e of token t that is not held and is the only non-held
    expert of t owned by its node; the row's experts are sorted by owner node (`g_TK`, -1 padded)."""
    K = e_TK.shape[1]
    k = 0
    while k < K and g_TK[t, k] >= 0:
        g = g_TK[t, k]
        count = 0
        last = -1
        while k < K and g_TK[t, k] == g:
            e = e_TK[t, k]
            if not held_E[e]:
                count += 1
                last = e
            k += 1
        if count == 1:
            gain_E[last] += weight


@_jit
def _solo_gains(e_TK, g_TK, t, n, weight, gain_E):  # noqa: ANN001, ANN202
    """Add `weight` to gain_E[e] for each expert of token t alone on its owner node, owner != n."""
    K = e_TK.shape[1]
    for k in range(K):
        g = g_TK[t, k]
        if g < 0:
            break
        if g != n and (k == 0 or g_TK[t, k - 1] != g) and (k + 1 == K or g_TK[t, k + 1] != g):
            gain_E[e_TK[t, k]] += weight


@_jit
def greedy_copies(sets_TK, src_node_T, node_of_E, holds_NE, count, own_weight):  # noqa: ANN001, ANN201
    """`[N, E]` int64 pick order of greedy traffic copies (int64 max = not picked), node by node.

    Node n weighs its own tokens `own_weight`, others 1. Each step picks the first expert with the largest
    alone gain (`replicas.alone_gains`; held experts gain 0) given what n holds so far; it stops at `count`
    picks or when the best gain is <= 0. Experts held on every node never count and are dropped first.
    Start gains: from the experts alone on their owner node in a token ("solo"), the same for every node
    that does not hold the token's other experts; tokens with an expert copied on n are recounted exactly.
    A pick of e only changes e's owner group in the tokens that contain e. Exact for integer weights.
    """
    T, K = sets_TK.shape
    N, E = holds_NE.shape
    big = np.iinfo(np.int64).max
    order_NE = np.full((N, E), big, dtype=np.int64)
    if T == 0 or count <= 0:
        return order_NE
    everywhere_E = np.ones(E, dtype=np.bool_)
    for n in range(N):
        for e in range(E):
            if not holds_NE[n, e]:
                everywhere_E[e] = False
    # Step 1: each token's other experts sorted by owner node (then id); where each sits in its row (CSR by e).
    e_TK = np.full((T, K), -1, dtype=np.int64)
    g_TK = np.full((T, K), -1, dtype=np.int64)
    deg = np.zeros(E + 1, dtype=np.int64)
    for t in range(T):
        c = 0
        for k in range(K):
            e = sets_TK[t, k]
            if e < 0 or everywhere_E[e]:
                continue
            deg[e + 1] += 1
            g = node_of_E[e]
            j = c
            while j > 0 and (g_TK[t, j - 1] > g or (g_TK[t, j - 1] == g and e_TK[t, j - 1] > e)):
                e_TK[t, j] = e_TK[t, j - 1]
                g_TK[t, j] = g_TK[t, j - 1]
                j -= 1
            e_TK[t, j] = e
            g_TK[t, j] = g
            c += 1
    for e in range(E):
        deg[e + 1] += deg[e]
    tok_P = np.empty(deg[E], dtype=np.int64)
    pos_P = np.empty(deg[E], dtype=np.int64)
    fill = deg[:E].copy()
    for t in range(T):
        for k in range(K):
            e = e_TK[t, k]
            if e < 0:
                break
            tok_P[fill[e]] = t
            pos_P[fill[e]] = k
            fill[e] += 1
    # Step 2: solo counts, all tokens and per source node.
    solo_E = np.zeros(E)
    solo_NE = np.zeros((N, E))
    for t in range(T):
        for k in range(K):
            g = g_TK[t, k]
            if g < 0:
                break
            if (k == 0 or g_TK[t, k - 1] != g) and (k + 1 == K or g_TK[t, k + 1] != g):
                solo_E[e_TK[t, k]] += 1.0
                solo_NE[src_node_T[t], e_TK[t, k]] += 1.0
    mark_T = np.zeros(T, dtype=np.bool_)
    gain = np.zeros(E)
    for n in range(N):
        held = holds_NE[n].copy()
        for e in range(E):
            gain[e] = 0.0 if node_of_E[e] == n else solo_E[e] + (own_weight - 1.0) * solo_NE[n, e]
        # Step 3: tokens with an expert copied on n (held, owned elsewhere): take their solo terms back, recount.
        for e in range(E):
            if not held[e] or node_of_E[e] == n:
                continue
            for p in range(deg[e], deg[e + 1]):
                t = tok_P[p]
                if mark_T[t]:
                    continue
                mark_T[t] = True
                w = own_weight if src_node_T[t] == n else 1.0
                _solo_gains(e_TK, g_TK, t, n, -w, gain)
                _grouped_alone(e_TK, g_TK, t, held, w, gain)
        for e in range(E):
            if held[e] and node_of_E[e] != n:
                for p in range(deg[e], deg[e + 1]):
                    mark_T[tok_P[p]] = False
        # Step 4: picks; after each, only the picked expert's owner group changes in its tokens.
        for i in range(count):
            best = -1
            best_gain = 0.0
            for e in range(E):
                g = 0.0 if held[e] else gain[e]
                if best < 0 or g > best_gain:
                    best = e
                    best_gain = g
            if best_gain <= 0:
                break
            for p in range(deg[best], deg[best + 1]):
                t = tok_P[p]
                k = pos_P[p]
                g = g_TK[t, k]
                others = 0
                other = -1
                j = k - 1
                while j >= 0 and g_TK[t, j] == g:
                    if not held[e_TK[t, j]]:
                        others += 1
                        other = e_TK[t, j]
                    j -= 1
                j = k + 1
                while j < K and g_TK[t, j] == g:
                    if not held[e_TK[t, j]]:
                        others += 1
                        other = e_TK[t, j]
                    j += 1
                w = own_weight if src_node_T[t] == n else 1.0
                if others == 0:
                    gain[best] -= w
                elif others == 1:
                    gain[other] += w
            held[best] = True
            order_NE[n, best] = i
    return order_NE


@_jit
def _copy_gain(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, e):  # noqa: ANN001, ANN202
    """N times the decrease of the value when view s toggles its copy of e (adds it when e counts in s,
    removes it otherwise): the sets of e where e is its owner's only counted expert (add) or where the
    owner has no counted expert (remove). Zero when s owns e (the copy changes nothing there)."""
    own = node_of_E[e]
    if own == s:
        return 0.0
    total = 0.0
    if active_SE[s, e]:
        for p in range(ptr_E[e], ptr_E[e + 1]):
            m = set_P[p]
            total += w_M[m] * _ind(cnt_MSN[m, s, own] == 1)
    else:
        for p in range(ptr_E[e], ptr_E[e + 1]):
            m = set_P[p]
            total -= w_M[m] * _ind(cnt_MSN[m, s, own] == 0)
    return total


@_jit
def _toggle_copy(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, s, e):  # noqa: ANN001, ANN202
    own = node_of_E[e]
    step = -1 if active_SE[s, e] else 1
    for p in range(ptr_E[e], ptr_E[e + 1]):
        cnt_MSN[set_P[p], s, own] += step
    active_SE[s, e] = not active_SE[s, e]


@_jit
def rep_copy_gains(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s):  # noqa: ANN001, ANN201
    """`[E]` decrease of the value when view s toggles its copy of each expert (`_copy_gain` / N)."""
    E = node_of_E.size
    N = active_SE.shape[0]
    out = np.empty(E)
    for e in range(E):
        out[e] = _copy_gain(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, e) / N
    return out


@_jit
def rep_copy_move_delta(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, e, f):  # noqa: ANN001, ANN201
    """Exact decrease of the value when view s drops its copy of e and takes one of f (e copied, f counted):
    the drop applied, the take's gain measured, the drop undone."""
    total = _copy_gain(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, e)
    _toggle_copy(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, s, e)
    total += _copy_gain(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, f)
    _toggle_copy(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, s, e)
    return total / active_SE.shape[0]


@_jit
def rep_toggle_copy(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, s, e):  # noqa: ANN001, ANN201
    _toggle_copy(ptr_E, set_P, cnt_MSN, node_of_E, active_SE, s, e)


@_jit
def rep_copy_gain(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, e):  # noqa: ANN001, ANN201
    """One entry of `rep_copy_gains`."""
    return _copy_gain(ptr_E, set_P, cnt_MSN, w_M, node_of_E, active_SE, s, e) / active_SE.shape[0]


ensure_built(_ind)  # the cache is compiled whole by one process (kernel_cache)
