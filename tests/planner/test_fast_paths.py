"""The compiled planner paths against simple numpy / Python references on small cases, degenerate shapes
included (1 node, one expert per rank, k = 1, experts nobody chooses, no tokens)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import sparse

from ds_cobalt.planner import assign as assign_mod
from ds_cobalt.planner.assign import assign_tasks, layout_tables, remote_nodes_per_token
from ds_cobalt.planner.objective import PartitionState, connectivity
from ds_cobalt.planner.policies import plan_layout
from ds_cobalt.planner.replicas import ReplicaPartitionState, alone_gains, traffic_order, traffic_replicas
from ds_cobalt.planner.stage1 import _repair_step, greedy_coact_partition, plan_nodes, refine_swaps
from ds_cobalt.planner.stage2 import pack_node, plan_gpus
from ds_cobalt.planner.stats import RoutingStats, topk_sets
from ds_cobalt.sim.synth import synth_trace

# ------------------------------------------------------------------------------------------------------------
# References: the planner's earlier numpy implementations (ties broken by index wherever they sort).


class RefPartitionState:
    """Numpy connectivity state (no batch methods: `refine_swaps` runs its Python steps on it)."""

    def __init__(self, sets_MK, count_M, node_of_E, nodes):
        self.E, self.N = int(node_of_E.size), int(nodes)
        m_P, k_P = np.nonzero(sets_MK >= 0)
        self.m_P, self.e_P = m_P, sets_MK[m_P, k_P].astype(np.int64)
        self.w_M = np.asarray(count_M, dtype=np.float64)
        M = sets_MK.shape[0]
        self.H_EM = sparse.csr_matrix((np.ones(self.e_P.size), (self.e_P, m_P)), shape=(self.E, M))
        self.sets_of_E = [self.H_EM.indices[self.H_EM.indptr[e]: self.H_EM.indptr[e + 1]] for e in range(self.E)]
        self.node_of_E = np.asarray(node_of_E, dtype=np.int64).copy()
        self.cnt_MN = np.zeros((M, self.N), dtype=np.int64)
        np.add.at(self.cnt_MN, (m_P, self.node_of_E[self.e_P]), 1)

    def value(self):
        return float((self.w_M * np.maximum((self.cnt_MN > 0).sum(axis=1) - 1, 0)).sum())

    def move_gains(self):
        alone_P = self.cnt_MN[self.m_P, self.node_of_E[self.e_P]] == 1
        leave_E = np.bincount(self.e_P, weights=self.w_M[self.m_P] * alone_P, minlength=self.E)
        gain = leave_E[:, None] - np.asarray(self.H_EM @ ((self.cnt_MN == 0) * self.w_M[:, None]))
        gain[np.arange(self.E), self.node_of_E] = -np.inf
        return gain

    def swap_delta(self, a, b):
        moved = self.node_of_E.copy()
        moved[[a, b]] = moved[[b, a]]
        node_MK = np.where(self._sets >= 0, moved[np.maximum(self._sets, 0)], -1)
        return self.value() - _km1(node_MK, self.w_M)

    def apply_swap(self, a, b):
        A, B = self.node_of_E[a], self.node_of_E[b]
        self.cnt_MN[self.sets_of_E[a], A] -= 1
        self.cnt_MN[self.sets_of_E[a], B] += 1
        self.cnt_MN[self.sets_of_E[b], B] -= 1
        self.cnt_MN[self.sets_of_E[b], A] += 1
        self.node_of_E[a], self.node_of_E[b] = B, A


def _km1(node_MK, w_M):
    node_MK = np.sort(node_MK, axis=1)
    new = np.ones(node_MK.shape, dtype=bool)
    new[:, 1:] = node_MK[:, 1:] != node_MK[:, :-1]
    return float((w_M * np.maximum(((node_MK >= 0) & new).sum(axis=1) - 1, 0)).sum())


def _ref_state(sets_MK, count_M, node_of_E, nodes):
    st = RefPartitionState(sets_MK, count_M, node_of_E, nodes)
    st._sets = sets_MK
    return st


class RefReplicaState:
    """Brute-force replica-aware value (views s = 0..N-1, copies on s local); Python-step refinement."""

    def __init__(self, sets_MK, count_M, node_of_E, copies_NE):
        self.N, self.E = copies_NE.shape
        self.sets, self.w, self.copies = sets_MK, np.asarray(count_M, float), copies_NE
        self.node_of_E = np.asarray(node_of_E, dtype=np.int64).copy()

    def _value(self, node_of_E):
        total = 0.0
        for s in range(self.N):
            for m in range(self.sets.shape[0]):
                nodes = {int(node_of_E[e]) for e in self.sets[m] if e >= 0 and not self.copies[s, e]}
                total += self.w[m] * len(nodes - {s})
        return total / self.N

    def value(self):
        return self._value(self.node_of_E)

    def move_gains(self):
        gain = np.full((self.E, self.N), -np.inf)
        base = self.value()
        for e, n in itertools.product(range(self.E), range(self.N)):
            if n != self.node_of_E[e]:
                moved = self.node_of_E.copy()
                moved[e] = n
                gain[e, n] = base - self._value(moved)
        return gain

    def swap_delta(self, a, b):
        moved = self.node_of_E.copy()
        moved[[a, b]] = moved[[b, a]]
        return self.value() - self._value(moved)

    def apply_swap(self, a, b):
        self.node_of_E[[a, b]] = self.node_of_E[[b, a]]


def _ref_traffic_replicas(topk, src_node, node_of_E, holds_NE, copies):
    N, E = holds_NE.shape
    extra = np.zeros((N, E), dtype=bool)
    if topk.shape[0] == 0 or N == 1 or copies <= 0:
        return extra
    for n in range(N):
        weight = 1.0 + (N - 1) * (src_node == n)
        held = holds_NE[n].copy()
        for _ in range(copies):
            gain = alone_gains(topk, weight, node_of_E, held, E)
            gain[held] = 0.0
            e = int(np.argmax(gain))
            if gain[e] <= 0:
                break
            held[e] = extra[n, e] = True
    return extra


def _ref_pack_node(owner_load, owner_ids, spare_load, spare_ids, G, R):
    per_gpu = owner_ids.size // G
    gpu_owner, gpu_spare = np.full(owner_ids.size, -1), np.full(spare_ids.size, -1)
    load_G, used_o, used_s = np.zeros(G), np.zeros(G, int), np.zeros(G, int)
    held = [set() for _ in range(G)]
    items = sorted([(float(owner_load[i]), 0, i) for i in range(owner_ids.size)]
                   + [(float(spare_load[i]), 1, i) for i in range(spare_ids.size)], key=lambda x: (-x[0], x[1], x[2]))
    for load, kind, i in items:
        e = int(owner_ids[i] if kind == 0 else spare_ids[i])
        free = used_o < per_gpu if kind == 0 else used_s < R
        ok = free & np.array([e not in h for h in held])
        if not ok.any():
            if kind == 1:
                continue
            ok = free
        g = int(np.argmin(np.where(ok, load_G, np.inf)))
        load_G[g] += load
        held[g].add(e)
        if kind == 0:
            gpu_owner[i], used_o[g] = g, used_o[g] + 1
        else:
            gpu_spare[i], used_s[g] = g, used_s[g] + 1
    for _ in range(4 * G):
        hi = int(np.argmax(load_G))
        best = (0.0, -1, -1, -1)
        for kind, gpu_of, loads, ids in ((0, gpu_owner, owner_load, owner_ids), (1, gpu_spare, spare_load, spare_ids)):
            on_hi = np.nonzero(gpu_of == hi)[0]
            for lo in np.argsort(load_G, kind="stable")[: min(G - 1, 3)]:
                on_lo = np.nonzero(gpu_of == lo)[0]
                if lo == hi or on_hi.size == 0 or on_lo.size == 0:
                    continue
                d = loads[on_hi][:, None] - loads[on_lo][None, :]
                gain = load_G[hi] - np.maximum(load_G[hi] - d, load_G[lo] + d)
                bad = np.isin(ids[on_hi], list(held[lo]))[:, None] | np.isin(ids[on_lo], list(held[hi]))[None, :]
                gain[(d <= 0) | bad] = 0.0
                ia, ib = np.unravel_index(int(np.argmax(gain)), gain.shape)
                if gain[ia, ib] > best[0] + 1e-12:
                    best = (float(gain[ia, ib]), kind, int(on_hi[ia]), int(on_lo[ib]))
        if best[1] < 0:
            break
        _, kind, a, b = best
        gpu_of, ids, loads = (gpu_owner, owner_ids, owner_load) if kind == 0 else (gpu_spare, spare_ids, spare_load)
        lo, d = int(gpu_of[b]), loads[a] - loads[b]
        held[hi].discard(int(ids[a]))
        held[lo].discard(int(ids[b]))
        held[hi].add(int(ids[b]))
        held[lo].add(int(ids[a]))
        gpu_of[a], gpu_of[b] = lo, hi
        load_G[hi] -= d
        load_G[lo] += d
    out = np.full((G, per_gpu + R), -1)
    for g in range(G):
        own = np.sort(owner_ids[gpu_owner == g])
        spare = spare_ids[gpu_spare == g]
        spare = [e for i, e in enumerate(spare) if e not in own and e not in spare[:i]]
        out[g, :per_gpu] = own
        out[g, per_gpu: per_gpu + len(spare)] = spare
    return out


def _ref_assign(topk, src, slots, G):
    """Steps 1-2 per pair in Python, steps 3-4 by the numpy spec `_cover_replicated`, step 5 in Python."""
    E = int(max(slots.max(initial=-1), topk.max(initial=-1))) + 1
    W = slots.shape[0]
    N = W // G
    tables = layout_tables(slots, G, E)
    holds, slot_of_WE, replicas = tables["holds_NE"], tables["slot_of_WE"], tables["replicas_NE"]
    T, K = topk.shape
    node = np.full((T, K), -2, dtype=np.int64)
    for t, k in itertools.product(range(T), range(K)):
        e, s = topk[t, k], src[t] // G
        if e >= 0:
            node[t, k] = s if holds[s, e] else (int(np.argmax(holds[:, e])) if holds[:, e].sum() == 1 else -1)
    rows = np.nonzero((node == -1).any(axis=1))[0]
    if rows.size:
        assign_mod._cover_replicated(rows, topk, node, node[rows] == -1, holds, src // G, N, True)
    count = {}
    for t, k in itertools.product(range(T), range(K)):
        if node[t, k] >= 0:
            count[(node[t, k], topk[t, k])] = count.get((node[t, k], topk[t, k]), 0) + 1
    ranks_of = {(n, e): [n * G + g for g in range(G) if slot_of_WE[n * G + g, e] >= 0] for (n, e) in count}
    load = np.zeros(W, dtype=np.int64)
    for key, c in count.items():
        if replicas[key] == 1:
            load[ranks_of[key][0]] += c
    queue = {}
    for key in sorted((k for k in count if replicas[k] > 1), key=lambda k: (-count[k], k[0] * E + k[1])):
        share = assign_mod._water_fill(load[ranks_of[key]], count[key])
        load[ranks_of[key]] += share
        queue[key] = [r for r, c in zip(ranks_of[key], share) for _ in range(c)]
    rank = np.full((T, K), -1, dtype=np.int64)
    slot = np.full((T, K), -1, dtype=np.int64)
    for t, k in itertools.product(range(T), range(K)):
        if node[t, k] >= 0:
            key = (node[t, k], topk[t, k])
            rank[t, k] = queue[key].pop(0) if key in queue else ranks_of[key][0]
            slot[t, k] = slot_of_WE[rank[t, k], topk[t, k]]
    return rank, slot


# ------------------------------------------------------------------------------------------------------------
# Task assignment


def _layout(rng, E, N, G, R, cross=True):
    W = N * G
    slots = np.full((W, E // W + R), -1, dtype=np.int64)
    slots[:, : E // W] = rng.permutation(E).reshape(W, E // W)
    for r, j in itertools.product(range(W), range(R)):
        if rng.random() < 0.8:
            pool = np.arange(E) if cross else slots[(r // G) * G: (r // G + 1) * G, : E // W].reshape(-1)
            slots[r, E // W + j] = rng.choice(pool)
    return slots


@pytest.mark.parametrize("E, N, G, R, K, T", [
    (16, 4, 2, 2, 4, 120), (12, 3, 2, 1, 3, 90), (8, 1, 4, 2, 3, 50),   # one node
    (8, 4, 2, 1, 2, 60),                                                 # E = ranks: one expert per GPU
    (16, 2, 4, 1, 1, 70),                                                # k = 1
    (24, 6, 1, 3, 5, 80), (16, 4, 2, 0, 4, 40), (8, 2, 2, 2, 3, 0),      # G = 1, no spare slots, no tokens
])
def test_assign_matches_reference(E, N, G, R, K, T):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        slots = _layout(rng, E, N, G, R, cross=seed != 1)
        topk = np.stack([rng.choice(E // 2 or 1, K) for _ in range(T)]) if T else np.zeros((0, K), int)
        topk[rng.random(topk.shape) < 0.15] = -1  # experts E/2.. are never chosen; some ids dropped
        src = rng.integers(0, N * G, T)
        rank, slot = assign_tasks(topk, src, slots, G)
        ref_rank, ref_slot = _ref_assign(topk, src, slots, G)
        assert np.array_equal(rank, ref_rank) and np.array_equal(slot, ref_slot)


def test_assign_equal_groups_lower_id_first():
    # One node, 2 GPUs: experts 0 and 1 on both, expert 2 on GPU 0 only. Groups (0, 0) and (0, 1) have equal
    # counts, so the water-filling order decides the shares: the lower flat id (expert 0) goes first.
    slots = np.array([[0, 1, 2], [0, 1, -1]])
    topk = np.array([[2], [0], [0], [0], [1], [1], [1]])
    rank, _ = assign_tasks(topk, np.zeros(7, int), slots, 2)
    assert rank[1:4, 0].tolist() == [0, 1, 1] and rank[4:, 0].tolist() == [0, 0, 1]
    assert np.array_equal(rank, _ref_assign(topk, np.zeros(7, int), slots, 2)[0])


def test_assign_all_dropped_and_errors():
    slots = np.arange(8).reshape(4, 2)
    rank, slot = assign_tasks(np.full((5, 3), -1), np.zeros(5, int), slots, 2)
    assert (rank == -1).all() and (slot == -1).all()
    with pytest.raises(ValueError, match="ids below -1"):
        assign_tasks(np.array([[9, -2]]), np.array([0]), slots, 2)  # checked before "held by no slot"
    with pytest.raises(ValueError, match=r"expert\(s\) \[9\] are chosen but held by no slot"):
        assign_tasks(np.array([[9, 1]]), np.array([0]), slots, 2)
    holes = slots.copy()
    holes[1, 0] = -1  # expert 2 held nowhere, inside the id range
    with pytest.raises(ValueError, match=r"\[2\] are chosen"):
        assign_tasks(np.array([[2, 0]]), np.array([3]), holes, 2)


def test_cover_rows_matches_numpy_spec():
    from ds_cobalt.planner import _assign_kernels

    rng = np.random.default_rng(3)
    E, N, G, K, T = 24, 6, 1, 6, 300
    slots = _layout(rng, E, N, G, 3)
    holds = layout_tables(slots, G, E)["holds_NE"]
    topk = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    src_node = rng.integers(0, N, T)
    direct = np.where(holds, np.arange(N)[:, None], np.where(holds.sum(0) == 1, np.argmax(holds, 0), -1)[None])
    node = direct[src_node[:, None], topk]
    rows = np.nonzero((node == -1).any(axis=1))[0]
    assert rows.size > 50
    ref = node.copy()
    assign_mod._cover_replicated(rows, topk, ref, ref[rows] == -1, holds, src_node, N, False)
    node_PK = node[rows].copy()
    _assign_kernels.cover_rows(rows, topk, node_PK, holds, src_node)
    assert np.array_equal(node_PK, ref[rows])


def test_remote_nodes_matches_brute_force():
    rng = np.random.default_rng(0)
    for G, W in ((1, 80), (4, 16), (2, 300)):  # 80 and 150 nodes: past the 64-node bit set
        dest = rng.integers(-1, W, (200, 6))
        src = rng.integers(0, W, 200)
        brute = [len({int(r) // G for r in row if r >= 0} - {int(s) // G}) for row, s in zip(dest, src)]
        assert remote_nodes_per_token(dest, src, G).tolist() == brute
    assert remote_nodes_per_token(np.zeros((0, 3), int), np.zeros(0, int), 2).shape == (0,)


# ------------------------------------------------------------------------------------------------------------
# Stage 1


def _stats(E, K, T, seed, N):
    tr = synth_trace(num_experts=E, top_k=K, num_tokens=T, gini=0.5, clustering=0.6, seed=seed)
    return RoutingStats.from_topk(tr.experts_LTK[0], E), tr


@pytest.mark.parametrize("E, K, N", [(24, 4, 4), (16, 1, 2), (8, 3, 8), (32, 6, 4)])
def test_partition_state_matches_reference(E, K, N):
    st, _ = _stats(E, K, 400, 1, N)
    rng = np.random.default_rng(2)
    node = rng.permutation(np.arange(E) % N)
    fast, ref = PartitionState(st.sets_MK, st.count_M, node, N), _ref_state(st.sets_MK, st.count_M, node, N)
    for _ in range(6):
        assert np.array_equal(fast.move_gains(), ref.move_gains())
        a_C, b_C = rng.integers(0, E, 40), rng.integers(0, E, 40)
        deltas = fast.swap_deltas(a_C, b_C)
        assert np.array_equal(deltas, [ref.swap_delta(a, b) for a, b in zip(a_C, b_C)])
        # A repair-shaped batch (all a on one node) takes the bit-set path; same values.
        A = int(node[0])
        a_R = np.nonzero(fast.node_of_E == A)[0][:3].repeat(5)
        b_R = rng.choice(np.nonzero(fast.node_of_E != A)[0], a_R.size)
        assert np.array_equal(fast.swap_deltas(a_R, b_R), [ref.swap_delta(a, b) for a, b in zip(a_R, b_R)])
        a, b = int(a_C[0]), int(b_C[0])
        assert fast.swap_delta(a, b) == ref.swap_delta(a, b)
        fast.apply_swap(a, b)
        ref.apply_swap(a, b)
        assert fast.value() == ref.value() == connectivity(st.sets_MK, st.count_M, fast.node_of_E)


@pytest.mark.parametrize("E, K, N, checks", [(32, 4, 4, None), (32, 4, 4, 4), (24, 1, 3, None), (16, 6, 2, None)])
def test_refine_swaps_compiled_equals_python_steps(E, K, N, checks):
    st, _ = _stats(E, K, 600, 4, N)
    load = st.load_E.astype(float)
    start = np.argsort(-load).argsort() // (E // N)  # hottest experts together: repairs first
    bound = 1.05 * load.sum() / N
    fast = PartitionState(st.sets_MK, st.count_M, start, N)
    ref = _ref_state(st.sets_MK, st.count_M, start, N)
    refine_swaps(fast, load, bound, repair_checks=checks)
    refine_swaps(ref, load, bound, repair_checks=checks)
    assert np.array_equal(fast.node_of_E, ref.node_of_E)


def test_repair_candidates_match_python_loop():
    st, _ = _stats(32, 4, 600, 5, 4)
    load = st.load_E.astype(float)
    node = np.argsort(-load).argsort() // 8
    state = PartitionState(st.sets_MK, st.count_M, node, 4)
    load_N = np.bincount(node, weights=load, minlength=4)
    bound = 1.02 * load.sum() / 4
    # Python loop of the documented candidate order (B, a, b ascending load, ties by index).
    A = int(np.argmax(load_N))
    hot = np.nonzero(node == A)[0]
    hot = hot[np.argsort(-load[hot])][:8]
    pairs = []
    for B in [int(B) for B in np.argsort(load_N)[:3] if B != A]:
        cold = np.nonzero(node == B)[0]
        for a in hot:
            ok = cold[load[cold] < load[a]]
            for b in ok[np.argsort(load[ok], kind="stable")][:8]:
                d = load[a] - load[b]
                if load_N[B] + d <= max(bound, load_N[A] - d) + 1e-9:
                    pairs.append((a, b))
    deltas = [state.swap_delta(a, b) for a, b in pairs]
    a, b = pairs[int(np.argmax(deltas))]
    expect = node.copy()
    expect[[a, b]] = expect[[b, a]]
    assert _repair_step(state, load, load_N, bound)
    assert np.array_equal(state.node_of_E, expect)


def test_greedy_seed_matches_python_loop():
    st, _ = _stats(32, 4, 500, 6, 4)
    for N in (1, 2, 4, 32):
        per, free, ref = 32 // N, np.ones(32, bool), np.empty(32, int)
        for n in range(N):
            members = [int(np.argmax(np.where(free, st.load_E, -1)))]
            free[members[0]] = False
            aff = st.coact_EE[members[0]].astype(float).copy()
            while len(members) < per:
                e = int(np.argmax(np.where(free, aff + 1e-9 * st.load_E, -np.inf)))
                members.append(e)
                free[e] = False
                aff += st.coact_EE[e]
            ref[members] = n
        assert np.array_equal(greedy_coact_partition(st.load_E, st.coact_EE, N), ref)


def test_plan_nodes_degenerate_and_deterministic():
    st, _ = _stats(16, 3, 300, 7, 4)
    args = (st.load_E, st.coact_EE, st.sets_MK, st.count_M)
    assert (plan_nodes(*args, 1) == 0).all()
    one_each = plan_nodes(*args, 16)  # one expert per node
    assert sorted(one_each.tolist()) == list(range(16))
    empty = RoutingStats(16, 3)  # no tokens at all: every expert empty
    node = plan_nodes(empty.load_E, empty.coact_EE, empty.sets_MK, empty.count_M, 4)
    assert np.bincount(node, minlength=4).tolist() == [4] * 4
    for part in ("auto", "kahypar", "fast"):  # Mt-KaHyPar runs single-threaded: same seed, same partition
        assert np.array_equal(plan_nodes(*args, 4, partitioner=part), plan_nodes(*args, 4, partitioner=part))


# ------------------------------------------------------------------------------------------------------------
# Replicas


@pytest.mark.parametrize("E, K, N", [(18, 4, 3), (12, 1, 4), (8, 3, 2)])
def test_replica_state_matches_reference(E, K, N):
    rng = np.random.default_rng(E + K)
    sets = topk_sets(np.stack([rng.choice(E, K, replace=False) for _ in range(40)]))
    w = rng.integers(1, 5, 40).astype(float)  # integer weights: exact
    node = rng.permutation(np.arange(E) % N)
    copies = rng.random((N, E)) < 0.25
    copies[:, 0] = True  # one expert copied on every node (counted in one view at most)
    fast, ref = ReplicaPartitionState(sets, w, node, copies), RefReplicaState(sets, w, node, copies)
    for _ in range(3):
        assert np.allclose(fast.move_gains(), ref.move_gains(), rtol=0, atol=1e-12)
        a_C, b_C = rng.integers(0, E, 12), rng.integers(0, E, 12)
        assert np.allclose(fast.swap_deltas(a_C, b_C), [ref.swap_delta(a, b) for a, b in zip(a_C, b_C)],
                           rtol=0, atol=1e-12)
        a, b = int(a_C[0]), int(b_C[0])
        fast.apply_swap(a, b)
        ref.apply_swap(a, b)
        assert fast.value() == pytest.approx(ref.value(), abs=1e-12)


def test_replica_refine_compiled_equals_python_steps():
    rng = np.random.default_rng(5)
    E, N = 12, 3
    sets = topk_sets(np.stack([rng.choice(E, 3, replace=False) for _ in range(30)]))
    w = rng.integers(1, 4, 30).astype(float)
    load = np.bincount(sets[sets >= 0], weights=np.repeat(w, (sets >= 0).sum(1)), minlength=E)
    start = np.argsort(-load).argsort() // 4
    copies = np.zeros((N, E), bool)
    copies[1, 0] = copies[2, 5] = True
    fast, ref = ReplicaPartitionState(sets, w, start, copies), RefReplicaState(sets, w, start, copies)
    for state in (fast, ref):
        refine_swaps(state, load, 1.05 * load.sum() / N, candidates=6, repair_checks=4)
    assert np.array_equal(fast.node_of_E, ref.node_of_E)


@pytest.mark.parametrize("E, N, K, T", [(32, 4, 4, 500), (16, 2, 1, 200), (12, 3, 6, 300), (16, 1, 3, 100),
                                        (16, 4, 3, 0)])
def test_traffic_copies_match_reference(E, N, K, T):
    rng = np.random.default_rng(E * N + K)
    tr = synth_trace(num_experts=E, top_k=K, num_tokens=max(T, 1), gini=0.5, seed=1)
    topk = tr.experts_LTK[0][:T].copy()
    topk[topk >= E - 2] = -1  # the last experts are never chosen
    src = rng.integers(0, N, T)
    node = rng.permutation(np.arange(E) % N)
    for variant in range(3):
        holds = np.zeros((N, E), bool)
        holds[node, np.arange(E)] = True
        if variant == 1:
            holds[:, :2] = True  # copies on every node
        if variant == 2:
            holds[rng.integers(0, N, 6), rng.integers(0, E, 6)] = True  # scattered copies
        order = traffic_order(topk, src, node, holds, 4)
        for copies in (0, 1, 4):
            ref = _ref_traffic_replicas(topk, src, node, holds, copies)
            assert np.array_equal(traffic_replicas(topk, src, node, holds, copies), ref)
            assert np.array_equal(order < copies, ref)


# ------------------------------------------------------------------------------------------------------------
# Stage 2 and the policies


def test_pack_node_matches_reference():
    rng = np.random.default_rng(0)
    for trial in range(60):
        G, per, R = int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(rng.integers(0, 3))
        ids = rng.choice(40, G * per, replace=False)
        load = rng.integers(0, 6, ids.size).astype(float)  # small integers: many ties
        n_spare = int(rng.integers(0, G * R + 3))
        spare_ids = rng.choice(ids, n_spare) if trial % 3 else rng.integers(0, 40, n_spare)
        spare_load = rng.integers(0, 6, n_spare).astype(float)
        out = pack_node(load, ids, spare_load, spare_ids, G, R)
        assert np.array_equal(out, _ref_pack_node(load, ids, spare_load, spare_ids, G, R)), trial


@pytest.mark.parametrize("E, K, N, G, R", [(16, 4, 2, 2, 1), (16, 1, 4, 4, 1), (8, 3, 1, 8, 2), (16, 2, 4, 2, 0)])
def test_policies_deterministic_on_degenerate_shapes(E, K, N, G, R):
    tr = synth_trace(num_experts=E, top_k=K, num_tokens=400, gini=0.5, seed=3)
    for policy in ("cobalt", "pairwise", "eplb", "load"):
        a, b = plan_layout(tr, N, G, R, policy), plan_layout(tr, N, G, R, policy)
        assert np.array_equal(a.slots_LWS, b.slots_LWS)
        slots = a.layer(0)
        for n in range(N):  # node loads of the layout: plan_gpus keeps owners, copies stay distinct per GPU
            block = slots[n * G: (n + 1) * G]
            for row in block:
                held = row[row >= 0]
                assert held.size == np.unique(held).size


def test_plan_gpus_one_node_one_expert_per_gpu():
    node = np.zeros(8, dtype=np.int64)
    load = np.arange(8, dtype=float)[None, :]
    slots = plan_gpus(node, np.zeros((1, 8), bool), load, 8, 1)
    assert sorted(slots[:, 0].tolist()) == list(range(8))
    assert 7 in slots[:, 1]  # the hottest expert gets the first spare copy, on another GPU
