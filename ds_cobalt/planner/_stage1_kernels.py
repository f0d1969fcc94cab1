"""Compiled loops of stage 1: `objective.PartitionState` and `stage1.refine_swaps` / seeds.

Legend: M sets, K top-k, E experts, N nodes, P pins (valid (set, expert) entries), C candidate pairs.
`ptr_E`/`set_P`: CSR of the sets each expert is in (ascending set index); `cnt_MN[m, n]`: experts of set m
on node n.

Compiled with numba (`njit`: one thread, cached on disk next to this file, numpy error model), imported lazily
by objective.py and stage1.py so that importing the planner does not load numba. Each kernel is the loop its
caller's docstring specifies; simple references they must agree with are in tests/planner/test_fast_paths.py.
Ties go to the lowest index (first maximum / minimum, stable sorts), never to sort internals. With integer
weights (token counts) every float sum is exact, so results do not depend on summation order.
Numba's cache does not notice edits to jitted functions of another file: kernels here call only kernels
defined in this file.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernel_cache import ensure_built

_jit = njit(cache=True, nogil=True, error_model="numpy")  # numpy error model: no Python-style division checks


@_jit
def set_csr(sets_MK, E):  # noqa: ANN001, ANN201
    """`(ptr_E, set_P)`: the sets of each expert, ascending (counting sort; repeats kept)."""
    M, K = sets_MK.shape
    ptr_E = np.zeros(E + 1, dtype=np.int64)
    for m in range(M):
        for k in range(K):
            e = sets_MK[m, k]
            if e >= 0:
                ptr_E[e + 1] += 1
    for e in range(E):
        ptr_E[e + 1] += ptr_E[e]
    fill = ptr_E[:E].copy()
    set_P = np.empty(ptr_E[E], dtype=np.int64)
    for m in range(M):
        for k in range(K):
            e = sets_MK[m, k]
            if e >= 0:
                set_P[fill[e]] = m
                fill[e] += 1
    return ptr_E, set_P


@_jit
def part_counts(ptr_E, set_P, node_of_E, cnt_MN):  # noqa: ANN001, ANN201
    """Fill `cnt_MN` (`[M, N]`, zeros; int8 when K < 128) with the experts of each set per node."""
    for e in range(node_of_E.size):
        n = node_of_E[e]
        for p in range(ptr_E[e], ptr_E[e + 1]):
            cnt_MN[set_P[p], n] += 1
    return cnt_MN


@_jit
def part_move_gains(sets_MK, cnt_MN, w_M, node_of_E):  # noqa: ANN001, ANN201
    """`[E, N]`: leave(e) - enter(e, n), each summed over e's sets in ascending order; -inf at own node.
    leave(e) = sum_{m in e} w_m [cnt(m, own) == 1], enter(e, n) = sum_{m in e} w_m [cnt(m, n) == 0]. Set-major
    (one pass over the sets, scattering into the small gain matrix)."""
    M, K = sets_MK.shape
    E = node_of_E.size
    N = cnt_MN.shape[1]
    leave = np.zeros(E)
    enter = np.zeros((E, N))
    absent = np.empty(N)
    for m in range(M):
        w = w_M[m]
        for n in range(N):  # branch-free
            absent[n] = w * (cnt_MN[m, n] == 0)
        for k in range(K):
            e = sets_MK[m, k]
            if e < 0:
                continue
            leave[e] += w * (cnt_MN[m, node_of_E[e]] == 1)
            for n in range(N):
                enter[e, n] += absent[n]
    gain = np.empty((E, N))
    for e in range(E):
        for n in range(N):
            gain[e, n] = leave[e] - enter[e, n]
        gain[e, node_of_E[e]] = -np.inf
    return gain


@_jit
def _ind(flag):  # noqa: ANN001, ANN202
    return 1.0 if flag else 0.0


@_jit
def _part_delta(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a, b):  # noqa: ANN001, ANN202
    """Exact decrease of connectivity when a and b exchange nodes; `mark_M` is zero on entry and exit."""
    A = node_of_E[a]
    B = node_of_E[b]
    if A == B:
        return 0.0
    for p in range(ptr_E[a], ptr_E[a + 1]):
        mark_M[set_P[p]] = 1
    total = 0.0
    for p in range(ptr_E[a], ptr_E[a + 1]):
        m = set_P[p]
        total += w_M[m] * (_ind(cnt_MN[m, A] == 1) - _ind(cnt_MN[m, B] == 0))
    for p in range(ptr_E[b], ptr_E[b + 1]):
        m = set_P[p]
        if mark_M[m]:
            total -= w_M[m] * _ind(cnt_MN[m, A] == 1)  # set holds both: its counts do not change
        else:
            total += w_M[m] * (_ind(cnt_MN[m, B] == 1) - _ind(cnt_MN[m, A] == 0))
    for p in range(ptr_E[a], ptr_E[a + 1]):
        mark_M[set_P[p]] = 0
    return total


@_jit
def part_swap_delta(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a, b):  # noqa: ANN001, ANN201
    return _part_delta(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a, b)


@_jit
def part_swap_deltas(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a_C, b_C):  # noqa: ANN001, ANN201
    """`[C]` exact swap deltas of the pairs (a_C[c], b_C[c]).

    delta(a, b) = g_a(B) + g_b(A) - sum over sets holding both of w ([cnt(m, A) == 1] + [cnt(m, B) == 1]),
    with g_x(Y) = sum_{m in x} w_m ([cnt(m, node x) == 1] - [cnt(m, Y) == 0]) (x moving alone to Y). One
    pass over each distinct a's sets gives g_a for every node; when every a sits on one node A (a repair
    step) and there are at most 64 of them, one pass over each distinct b's sets gives g_b(A) and the
    shared-set terms of all its pairs (a bitmask per set says which a's it holds); otherwise each pair walks
    b's sets. Exact for integer weights.
    """
    C = a_C.size
    N = cnt_MN.shape[1]
    out = np.zeros(C)
    if C == 0:
        return out
    ua = np.unique(a_C)
    U = ua.size
    A = node_of_E[ua[0]]
    one_node = U <= 64
    for i in range(U):
        if node_of_E[ua[i]] != A:
            one_node = False
    if not one_node:
        return _part_deltas_pairwise(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a_C, b_C)
    # Step 1: per distinct a, alone_U - absent_UN[., B] = g_a(B); bit i of mask_M marks a's sets.
    alone_U = np.zeros(U)
    absent_UN = np.zeros((U, N))
    acc_N = np.zeros(N)
    mask_M = np.zeros(cnt_MN.shape[0], dtype=np.uint64)
    slot_E = np.full(node_of_E.size, -1, dtype=np.int64)
    for i in range(U):
        a = ua[i]
        slot_E[a] = i
        bit = np.uint64(1) << np.uint64(i)
        alone = 0.0
        acc_N[:] = 0.0
        for p in range(ptr_E[a], ptr_E[a + 1]):
            m = set_P[p]
            mask_M[m] |= bit
            w = w_M[m]
            alone += w * (cnt_MN[m, A] == 1)
            for n in range(N):  # branch-free
                acc_N[n] += w * (cnt_MN[m, n] == 0)
        alone_U[i] = alone
        absent_UN[i] = acc_N
    # Step 2: per distinct b, g_b(A) and the shared-set terms with every a.
    order = np.argsort(b_C)
    shared_U = np.zeros(U)
    q = 0
    while q < C:
        b = b_C[order[q]]
        r = q
        while r < C and b_C[order[r]] == b:
            r += 1
        B = node_of_E[b]
        if B != A:
            g_b = 0.0
            shared_U[:] = 0.0
            for p in range(ptr_E[b], ptr_E[b + 1]):
                m = set_P[p]
                w = w_M[m]
                cA = cnt_MN[m, A]
                cB = cnt_MN[m, B]
                g_b += w * (cB == 1) - w * (cA == 0)
                mk = mask_M[m]
                if mk != 0:
                    both = w * (cA == 1) + w * (cB == 1)
                    for i in range(U):
                        shared_U[i] += both * ((mk >> np.uint64(i)) & np.uint64(1))
            for t in range(q, r):
                c = order[t]
                i = slot_E[a_C[c]]
                out[c] = alone_U[i] - absent_UN[i, B] + g_b - shared_U[i]
        q = r
    return out


@_jit
def _part_deltas_pairwise(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a_C, b_C):  # noqa: ANN001, ANN202
    C = a_C.size
    N = cnt_MN.shape[1]
    out = np.zeros(C)
    order = np.argsort(a_C)
    absent_N = np.empty(N)
    i = 0
    while i < C:
        a = a_C[order[i]]
        j = i
        while j < C and a_C[order[j]] == a:
            j += 1
        A = node_of_E[a]
        alone = 0.0
        absent_N[:] = 0.0
        for p in range(ptr_E[a], ptr_E[a + 1]):
            m = set_P[p]
            mark_M[m] = 1
            w = w_M[m]
            row = cnt_MN[m]
            alone += w * (row[A] == 1)
            for n in range(N):  # branch-free
                absent_N[n] += w * (row[n] == 0)
        for q in range(i, j):
            c = order[q]
            b = b_C[c]
            B = node_of_E[b]
            if A == B:
                continue
            total = alone - absent_N[B]
            for p in range(ptr_E[b], ptr_E[b + 1]):
                m = set_P[p]
                if mark_M[m]:
                    total -= w_M[m] * _ind(cnt_MN[m, A] == 1)
                else:
                    total += w_M[m] * (_ind(cnt_MN[m, B] == 1) - _ind(cnt_MN[m, A] == 0))
            out[c] = total
        for p in range(ptr_E[a], ptr_E[a + 1]):
            mark_M[set_P[p]] = 0
        i = j
    return out


@_jit
def _part_apply(ptr_E, set_P, cnt_MN, node_of_E, a, b):  # noqa: ANN001, ANN202
    A = node_of_E[a]
    B = node_of_E[b]
    for p in range(ptr_E[a], ptr_E[a + 1]):
        m = set_P[p]
        cnt_MN[m, A] -= 1
        cnt_MN[m, B] += 1
    for p in range(ptr_E[b], ptr_E[b + 1]):
        m = set_P[p]
        cnt_MN[m, B] -= 1
        cnt_MN[m, A] += 1
    node_of_E[a] = B
    node_of_E[b] = A


@_jit
def part_apply_swap(ptr_E, set_P, cnt_MN, node_of_E, a, b):  # noqa: ANN001, ANN201
    _part_apply(ptr_E, set_P, cnt_MN, node_of_E, a, b)


@_jit
def part_try_swaps(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a_C, b_C, load_E, load_N,  # noqa: ANN001, ANN201
                   bound):
    """Step 3 of `refine_swaps`: in order, apply every untouched, load-feasible pair with delta > 1e-9."""
    touched = np.zeros(node_of_E.size, dtype=np.bool_)
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
        if _part_delta(ptr_E, set_P, cnt_MN, w_M, node_of_E, mark_M, a, b) > 1e-9:
            _part_apply(ptr_E, set_P, cnt_MN, node_of_E, a, b)
            load_N[A] += dA
            load_N[B] -= dA
            touched[a] = True
            touched[b] = True
            improved = True
    return improved


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
def best_back_members(gain_EN, node_of_E, N):  # noqa: ANN001, ANN201
    """`[N, N]` int64: the expert of node B with the largest gain_EN[., A] (first in index order)."""
    E = node_of_E.size
    best = np.full((N, N), -1, dtype=np.int64)
    val = np.full((N, N), -np.inf)
    for e in range(E):
        B = node_of_E[e]
        for A in range(N):
            g = gain_EN[e, A]
            if best[B, A] < 0 or g > val[B, A]:
                best[B, A] = e
                val[B, A] = g
    return best


@_jit
def repair_pairs(node_of_E, load_E, load_N, hot, light, A, bound):  # noqa: ANN001, ANN201
    """Candidate repair swaps (a in `hot` of node A, b a colder expert of a light node B), in the order
    B (as in `light`), a (as in `hot`), b (8 coldest colder ones, ascending load, ties by index); kept when
    B stays within max(bound, load_N[A] - d) + 1e-9."""
    E = node_of_E.size
    cap = light.size * hot.size * 8
    a_C = np.empty(cap, dtype=np.int64)
    b_C = np.empty(cap, dtype=np.int64)
    c = 0
    for B in light:
        if B == A:
            continue
        n_cold = 0
        for e in range(E):
            if node_of_E[e] == B:
                n_cold += 1
        cold = np.empty(n_cold, dtype=np.int64)
        i = 0
        for e in range(E):
            if node_of_E[e] == B:
                cold[i] = e
                i += 1
        key = np.empty(n_cold)
        for i in range(n_cold):
            key[i] = load_E[cold[i]]
        order = _stable_order(key)
        for a in hot:
            taken = 0
            for i in range(n_cold):
                if taken == 8:
                    break
                b = cold[order[i]]
                if not load_E[b] < load_E[a]:
                    break  # ascending loads: none after this one is colder than a
                taken += 1
                d = load_E[a] - load_E[b]
                if load_N[B] + d <= max(bound, load_N[A] - d) + 1e-9:
                    a_C[c] = a
                    b_C[c] = b
                    c += 1
    return a_C[:c], b_C[:c]


@_jit
def greedy_coact(load_E, coact_EE, N):  # noqa: ANN001, ANN201
    """See stage1.greedy_coact_partition: per node, seed with the hottest free expert (first maximum), then
    add the free expert maximising affinity + 1e-9 load (first maximum) until E / N."""
    E = load_E.size
    per = E // N
    free = np.ones(E, dtype=np.bool_)
    node_of_E = np.empty(E, dtype=np.int64)
    affinity = np.empty(E)
    for n in range(N):
        seed = -1
        best = 0.0
        for e in range(E):
            v = load_E[e] if free[e] else -1.0
            if seed < 0 or v > best:
                seed = e
                best = v
        free[seed] = False
        node_of_E[seed] = n
        for j in range(E):
            affinity[j] = coact_EE[seed, j]
        for _ in range(per - 1):
            pick = -1
            best = -np.inf
            for j in range(E):
                if free[j]:
                    v = affinity[j] + 1e-9 * load_E[j]
                    if pick < 0 or v > best:
                        pick = j
                        best = v
            free[pick] = False
            node_of_E[pick] = n
            for j in range(E):
                affinity[j] += coact_EE[pick, j]
    return node_of_E


ensure_built(set_csr)  # the cache is compiled whole by one process (kernel_cache)
