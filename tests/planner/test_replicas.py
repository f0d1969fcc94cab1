"""Cross-node traffic copies, the replica-aware owner objective, and the fast task assignment paths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ds_cobalt.planner.assign import assign_tasks, remote_nodes_per_token
from ds_cobalt.planner.policies import plan_layout, refine_owners
from ds_cobalt.planner.replicas import ReplicaPartitionState, alone_gains, traffic_replicas
from ds_cobalt.planner.stats import topk_sets
from ds_cobalt.sim.metrics import simulate
from ds_cobalt.sim.synth import synth_trace


def _remote_owner_nodes(topk_TK, src_node, node_of_E, holds_E):
    """Brute force: distinct owner nodes of a token's non-held experts (excluding its own node)."""
    return sum(len({int(node_of_E[e]) for e in row if e >= 0 and not holds_E[e]} - {src_node}) for row in topk_TK)


@pytest.mark.parametrize("E, N, K, T, seed", [(8, 2, 2, 40, 0), (12, 3, 4, 60, 1), (16, 4, 1, 50, 2), (6, 1, 3, 20, 3)])
def test_alone_gains_match_brute_force(E, N, K, T, seed):
    rng = np.random.default_rng(seed)
    topk = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    topk[rng.random((T, K)) < 0.1] = -1
    node_of_E = rng.permutation(np.arange(E) % N)
    s = 0
    holds = node_of_E == s
    holds[rng.integers(0, E)] = True
    gain = alone_gains(topk, np.ones(T), node_of_E, holds, E)
    base = _remote_owner_nodes(topk, s, node_of_E, holds)
    for e in range(E):
        more = holds.copy()
        more[e] = True
        expect = 0.0 if holds[e] else base - _remote_owner_nodes(topk, s, node_of_E, more)
        assert gain[e] == pytest.approx(expect), e


def test_alone_gains_repeated_ids_count_once():
    topk = np.array([[3, 3, -1]])
    gain = alone_gains(topk, np.ones(1), np.array([0, 0, 0, 1]), np.array([True, True, True, False]), 4)
    assert gain.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_traffic_replicas_properties():
    tr = synth_trace(num_experts=32, top_k=4, num_tokens=600, gini=0.4, seed=5)
    topk = tr.experts_LTK[0]
    N = 4
    node_of_E = np.arange(32) // 8
    holds = np.zeros((N, 32), bool)
    holds[node_of_E, np.arange(32)] = True
    src = np.arange(600) * N // 600
    extra = traffic_replicas(topk, src, node_of_E, holds, 3)
    assert extra.shape == (N, 32) and (extra.sum(axis=1) <= 3).all()
    assert not (extra & holds).any()
    # Copies never raise the token count of remote nodes (the assignment only gains options).
    slots_plain = np.arange(32).reshape(16, 2)
    before = remote_nodes_per_token(assign_tasks(topk, src * 4, slots_plain, 4)[0], src * 4, 4).mean()
    slots = np.full((16, 3), -1)
    slots[:, :2] = slots_plain
    for n in range(N):
        for g, e in enumerate(np.nonzero(extra[n])[0]):
            slots[n * 4 + g, 2] = e
    after = remote_nodes_per_token(assign_tasks(topk, src * 4, slots, 4)[0], src * 4, 4).mean()
    assert after < before
    # Degenerate: one node, no tokens, no copies allowed.
    assert not traffic_replicas(topk, np.zeros(600, int), np.zeros(32, int), np.ones((1, 32), bool), 2).any()
    assert not traffic_replicas(topk[:0], src[:0], node_of_E, holds, 2).any()
    assert not traffic_replicas(topk, src, node_of_E, holds, 0).any()


def test_replica_partition_state_exact():
    rng = np.random.default_rng(1)
    E, N, K, M = 18, 3, 4, 50
    sets = topk_sets(np.stack([rng.choice(E, K, replace=False) for _ in range(M)]))
    w = rng.random(M)
    node = np.arange(E) % N
    copies = rng.random((N, E)) < 0.2

    def value(node_of_E):
        # Brute force: mean over source nodes s of weighted remote nodes, copies on s local.
        total = 0.0
        for s in range(N):
            for m in range(M):
                total += w[m] * len({int(node_of_E[e]) for e in sets[m] if e >= 0 and not copies[s, e]} - {s})
        return total / N

    st = ReplicaPartitionState(sets, w, node, copies)
    assert st.value() == pytest.approx(value(node))
    gain = st.move_gains()
    for e, n in itertools.product(range(4), range(N)):
        if n != node[e]:
            moved = node.copy()
            moved[e] = n
            assert gain[e, n] == pytest.approx(value(node) - value(moved))
    for _ in range(20):
        a, b = rng.integers(0, E, 2)
        swapped = st.node_of_E.copy()
        swapped[[a, b]] = swapped[[b, a]]
        assert st.swap_delta(a, b) == pytest.approx(st.value() - value(swapped))
        st.apply_swap(a, b)
        assert st.value() == pytest.approx(value(st.node_of_E))


def test_refine_owners_keeps_counts_and_does_not_worsen():
    tr = synth_trace(num_experts=32, top_k=4, num_tokens=800, gini=0.3, clustering=0.7, seed=3)
    sets = topk_sets(tr.experts_LTK[0])
    load = np.bincount(sets[sets >= 0], minlength=32).astype(float)
    node = np.arange(32) % 4
    copies = np.zeros((4, 32), bool)
    copies[:, np.argsort(-load)[:2]] = True
    new = refine_owners(sets, np.ones(sets.shape[0]), load, node, copies)
    assert np.bincount(new, minlength=4).tolist() == [8, 8, 8, 8]
    copies_off = copies & (node[None, :] != np.arange(4)[:, None])
    before = ReplicaPartitionState(sets, np.ones(sets.shape[0]), node, copies_off).value()
    after = ReplicaPartitionState(sets, np.ones(sets.shape[0]), new, copies_off).value()
    assert after <= before + 1e-9


def test_cobalt_no_worse_than_eplb_on_sample():
    tr = synth_trace(num_experts=32, top_k=4, num_tokens=2000, gini=0.5, clustering=0.6, seed=4)
    for R in (0, 1):
        co = simulate(tr, plan_layout(tr, 2, 4, R, "cobalt"))["mean"]
        ep = simulate(tr, plan_layout(tr, 2, 4, R, "eplb"))["mean"]
        assert co["cross_node_tokens_per_token"] <= ep["cross_node_tokens_per_token"] + 1e-12
        assert co["gpu_load_max_over_mean"] <= ep["gpu_load_max_over_mean"] + 1e-12


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_assign_dropped_and_replicated_groups(dtype):
    # 2 nodes x 2 GPUs; expert 0 replicated on both GPUs of node 0 and on node 1 (cross-node copy).
    slots = np.array([[0, 1], [2, 0], [3, 4], [5, 0]], dtype=dtype)
    topk = np.array([[0, -1], [0, 1], [0, 3], [-1, -1]] * 25, dtype=dtype)
    src = np.array([0, 1, 2, 3] * 25, dtype=dtype)
    dest, slot = assign_tasks(topk, src, slots, 2)
    assert ((topk < 0) == (dest < 0)).all()
    ok = topk >= 0
    assert (slots[dest[ok], slot[ok]] == topk[ok]).all()
    # Every token is served on its own node for expert 0 (both nodes hold it).
    assert (dest[ok & (topk == 0)] // 2 == np.broadcast_to(src[:, None] // 2, topk.shape)[ok & (topk == 0)]).all()


def test_plan_nodes_fast_partitioner_and_repair_options():
    from ds_cobalt.planner.objective import PartitionState
    from ds_cobalt.planner.stage1 import plan_nodes, refine_swaps
    from ds_cobalt.planner.stats import RoutingStats

    tr = synth_trace(num_experts=32, top_k=4, num_tokens=1500, gini=0.5, clustering=0.7, seed=6)
    st = RoutingStats.from_topk(tr.experts_LTK[0], 32)
    fast = plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 4, partitioner="fast")
    assert np.bincount(fast, minlength=4).tolist() == [8] * 4
    with pytest.raises(ValueError, match="partitioner must be auto, fast"):
        plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 4, partitioner="nope")
    # base_load_N counts in the node-load bound; ranked repairs still reach it from a bad start.
    load = st.load_E.astype(float)
    start = np.argsort(-load).argsort() // 8  # hottest 8 experts together: node 0 overloaded
    base = np.array([0.0, 0.0, 0.0, 0.1 * load.sum()])
    bound = 1.1 * (load.sum() + base.sum()) / 4
    for checks in (None, 4):
        state = PartitionState(st.sets_MK, st.count_M, start, 4)
        refine_swaps(state, load, bound, base_load_N=base, repair_checks=checks)
        node_load = np.bincount(state.node_of_E, weights=load, minlength=4) + base
        assert node_load.max() <= bound + 1e-6
        assert np.bincount(state.node_of_E, minlength=4).tolist() == [8] * 4


def test_metis_seed_optional_and_exact_counts(monkeypatch):
    import sys

    from ds_cobalt.planner.stage1 import metis_partition, plan_nodes
    from ds_cobalt.planner.stats import RoutingStats

    tr = synth_trace(num_experts=32, top_k=4, num_tokens=1000, seed=8)
    st = RoutingStats.from_topk(tr.experts_LTK[0], 32)
    part = metis_partition(st.load_E, st.coact_EE, 4)
    if part is not None:
        assert np.bincount(part, minlength=4).tolist() == [8] * 4
    assert metis_partition(np.ones(8), np.zeros((8, 8)), 2) is None  # no edges: no METIS seed
    # Without pymetis the planner still works (the seed is optional).
    monkeypatch.setitem(sys.modules, "pymetis", None)
    assert metis_partition(st.load_E, st.coact_EE, 4) is None
    node = plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 4, partitioner="fast")
    assert np.bincount(node, minlength=4).tolist() == [8] * 4
