"""Compiled loop of `stage2.pack_node` (LPT + swap polish of one node).

Legend: G GPUs of the node, R spare slots per GPU, I items (owners and spare copies).

Compiled with numba (`njit`: one thread, cached on disk next to this file, numpy error model), imported lazily
by stage2.py so that importing the planner does not load numba. Each kernel is the loop its caller's docstring
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
def pack_items(load_I, kind_I, idx_I, ids_I, n_owner, n_spare, G, R, num_ids):  # noqa: ANN001, ANN201
    """LPT then swap polish of one node (see stage2.pack_node); items are given heaviest first.

    Returns the `[G, O/G + R]` slots.
    """
    per_gpu = n_owner // G
    gpu_of = (np.full(n_owner, -1, dtype=np.int64), np.full(n_spare, -1, dtype=np.int64))
    gpu_owner, gpu_spare = gpu_of
    load_O = np.zeros(n_owner)
    load_X = np.zeros(n_spare)
    ids_O = np.zeros(n_owner, dtype=np.int64)
    ids_X = np.zeros(n_spare, dtype=np.int64)
    load_G = np.zeros(G)
    used_owner = np.zeros(G, dtype=np.int64)
    used_spare = np.zeros(G, dtype=np.int64)
    held = np.zeros((G, num_ids), dtype=np.bool_)
    # Step 1: LPT, each item on the lightest GPU with a free slot of its kind and no copy of the same expert.
    for it in range(load_I.size):
        load = load_I[it]
        kind = kind_I[it]
        i = idx_I[it]
        e = ids_I[it]
        if kind == 0:
            load_O[i] = load
            ids_O[i] = e
        else:
            load_X[i] = load
            ids_X[i] = e
        g = -1
        for h in range(G):
            free = used_owner[h] < per_gpu if kind == 0 else used_spare[h] < R
            if free and not held[h, e] and (g < 0 or load_G[h] < load_G[g]):
                g = h
        if g < 0:
            if kind == 1:
                continue  # no GPU can take another copy: the spare slot stays empty
            for h in range(G):
                if used_owner[h] < per_gpu and (g < 0 or load_G[h] < load_G[g]):
                    g = h
        load_G[g] += load
        held[g, e] = True
        if kind == 0:
            gpu_owner[i] = g
            used_owner[g] += 1
        else:
            gpu_spare[i] = g
            used_spare[g] += 1
    # Step 2: swap polish between the heaviest GPU and the (up to 3) lightest others, same-kind items.
    n_lo = min(G - 1, 3)
    for _ in range(4 * G):
        hi = 0
        for g in range(1, G):
            if load_G[g] > load_G[hi]:
                hi = g
        lights = _stable_order(load_G)[:n_lo]
        best_gain = 0.0
        best_kind = -1
        best_a = -1
        best_b = -1
        for kind in range(2):
            gpu_k = gpu_owner if kind == 0 else gpu_spare
            load_k = load_O if kind == 0 else load_X
            ids_k = ids_O if kind == 0 else ids_X
            n_k = gpu_k.size
            any_hi = False
            for a in range(n_k):
                if gpu_k[a] == hi:
                    any_hi = True
                    break
            for lo in lights:
                if lo == hi or not any_hi:
                    continue
                mx = -np.inf
                ma = -1
                mb = -1
                for a in range(n_k):
                    if gpu_k[a] != hi:
                        continue
                    for b in range(n_k):
                        if gpu_k[b] != lo:
                            continue
                        d = load_k[a] - load_k[b]
                        gain = load_G[hi] - max(load_G[hi] - d, load_G[lo] + d)
                        if d <= 0 or held[lo, ids_k[a]] or held[hi, ids_k[b]]:
                            gain = 0.0
                        if gain > mx:
                            mx = gain
                            ma = a
                            mb = b
                if ma >= 0 and mx > best_gain + 1e-12:
                    best_gain = mx
                    best_kind = kind
                    best_a = ma
                    best_b = mb
        if best_kind < 0:
            break
        gpu_k = gpu_owner if best_kind == 0 else gpu_spare
        load_k = load_O if best_kind == 0 else load_X
        ids_k = ids_O if best_kind == 0 else ids_X
        lo = gpu_k[best_b]
        d = load_k[best_a] - load_k[best_b]
        held[hi, ids_k[best_a]] = False
        held[lo, ids_k[best_b]] = False
        held[hi, ids_k[best_b]] = True
        held[lo, ids_k[best_a]] = True
        gpu_k[best_a] = lo
        gpu_k[best_b] = hi
        load_G[hi] -= d
        load_G[lo] += d
    # Output: owners sorted per GPU, then its spare items in index order (a copy of an expert the GPU already
    # holds, e.g. an owner forced onto it, is dropped).
    out = np.full((G, per_gpu + R), -1, dtype=np.int64)
    used = np.zeros((G, num_ids), dtype=np.bool_)
    n_out = np.zeros(G, dtype=np.int64)
    for i in np.argsort(ids_O):
        g = gpu_owner[i]
        out[g, n_out[g]] = ids_O[i]
        used[g, ids_O[i]] = True
        n_out[g] += 1
    for i in range(n_spare):
        g = gpu_spare[i]
        if g < 0 or used[g, ids_X[i]]:
            continue
        out[g, n_out[g]] = ids_X[i]
        used[g, ids_X[i]] = True
        n_out[g] += 1
    return out


ensure_built(_stable_order)  # the cache is compiled whole by one process (kernel_cache)
