"""Trace format, statistics and objective tests (numpy only)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ds_cobalt.planner.objective import PartitionState, connectivity, expected_remote_nodes
from ds_cobalt.planner.stats import RoutingStats, count_routing, topk_sets
from ds_cobalt.planner.trace import Trace, load_trace, save_trace
from ds_cobalt.sim.synth import gini, synth_trace


def test_trace_round_trip(tmp_path):
    tr = synth_trace(num_experts=16, top_k=3, num_tokens=50, num_layers=2, seed=3)
    full = Trace(tr.experts_LTK, 16, np.arange(50) % 4, np.random.rand(2, 50, 3).astype(np.float32))
    save_trace(full, tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    assert np.array_equal(back.experts_LTK, full.experts_LTK)
    assert back.num_experts == 16
    assert np.array_equal(back.source_rank_T, full.source_rank_T)
    assert np.allclose(back.weights_LTK, full.weights_LTK)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"experts": np.zeros((2, 3), np.int64)}, "'experts' must have shape"),
        ({"experts": np.zeros((1, 3, 2), np.float32)}, "'experts' must be an integer"),
        ({"experts": np.full((1, 3, 2), 9)}, "'experts' holds id 9"),
        ({"experts": np.full((1, 3, 2), -2)}, "'experts' holds id -2"),
        ({"num_experts": np.asarray(0)}, "'num_experts' must be a positive"),
        ({"source_rank": np.zeros(4, np.int64)}, "'source_rank' must have shape"),
        ({"weights": np.zeros((1, 3, 3), np.float32)}, "'weights' must have the shape"),
        ({"weights": np.zeros((1, 3, 2), np.int64)}, "'weights' must be a float"),
    ],
)
def test_trace_bad_fields(tmp_path, fields, match):
    base = {"experts": np.zeros((1, 3, 2), np.int64), "num_experts": np.asarray(8)}
    base.update(fields)
    np.savez(tmp_path / "bad.npz", **base)
    with pytest.raises(ValueError, match=match):
        load_trace(tmp_path / "bad.npz")


def test_trace_missing_field(tmp_path):
    np.savez(tmp_path / "bad.npz", experts=np.zeros((1, 3, 2), np.int64))
    with pytest.raises(ValueError, match="missing field 'num_experts'"):
        load_trace(tmp_path / "bad.npz")


def test_empty_trace_round_trip(tmp_path):
    tr = Trace(np.zeros((1, 0, 2), np.int64), 4)
    save_trace(tr, tmp_path / "e.npz")
    assert load_trace(tmp_path / "e.npz").num_tokens == 0


def _brute_counts(topk, E):
    load = np.zeros(E, np.int64)
    coact = np.zeros((E, E), np.int64)
    for row in topk:
        s = sorted({int(e) for e in row if e >= 0})
        for e in s:
            load[e] += 1
        for a, b in itertools.permutations(s, 2):
            coact[a, b] += 1
    return load, coact


@pytest.mark.parametrize("T, K, E", [(0, 2, 4), (1, 1, 1), (40, 1, 5), (60, 3, 6), (80, 4, 12)])
def test_count_routing_matches_brute_force(T, K, E):
    rng = np.random.default_rng(T + K)
    topk = rng.integers(-1, E, size=(T, K))
    load, coact = count_routing(topk, E)
    ref_load, ref_coact = _brute_counts(topk, E)
    assert np.array_equal(load, ref_load) and np.array_equal(coact, ref_coact)


def test_topk_sets_sorted_dedup():
    sets = topk_sets(np.array([[3, -1, 1, 3], [-1, -1, -1, -1]]))
    assert sets.tolist() == [[1, 3, -1, -1], [-1, -1, -1, -1]]


def test_stats_ema_and_merge():
    rng = np.random.default_rng(0)
    a_TK, b_TK = rng.integers(0, 6, (30, 2)), rng.integers(0, 6, (20, 2))
    st = RoutingStats(6, 2, decay=0.5)
    st.update(a_TK)
    st.update(b_TK)
    la, ca = count_routing(a_TK, 6)
    lb, cb = count_routing(b_TK, 6)
    assert np.allclose(st.load_E, 0.5 * la + lb)
    assert np.allclose(st.coact_EE, 0.5 * ca + cb)
    # The set histogram carries the same total weight as the tokens.
    assert np.isclose(st.count_M.sum(), 0.5 * 30 + 20)
    other = RoutingStats.from_topk(a_TK, 6)
    st.merge(other)
    assert np.allclose(st.load_E, 1.5 * la + lb)
    with pytest.raises(ValueError, match="shapes differ"):
        st.merge(RoutingStats(7, 2))


def test_objective_two_ways():
    """Connectivity from the sets equals the incremental PartitionState, before and after swaps."""
    tr = synth_trace(num_experts=24, top_k=4, num_tokens=500, seed=5)
    st = RoutingStats.from_topk(tr.experts_LTK[0], 24)
    node_of_E = np.random.default_rng(1).permutation(np.arange(24) % 4)
    state = PartitionState(st.sets_MK, st.count_M, node_of_E, 4)
    assert np.isclose(state.value(), connectivity(st.sets_MK, st.count_M, node_of_E))
    for a, b in [(0, 5), (3, 17), (9, 22)]:
        before = state.value()
        delta = state.swap_delta(a, b)
        state.apply_swap(a, b)
        assert np.isclose(before - state.value(), delta)
    assert np.isclose(state.value(), connectivity(st.sets_MK, st.count_M, state.node_of_E))
    # Per-token brute force: distinct nodes - 1 summed over tokens.
    brute = sum(len({state.node_of_E[e] for e in row}) - 1 for row in tr.experts_LTK[0])
    assert np.isclose(state.value(), brute)
    exp = expected_remote_nodes(st.sets_MK, st.count_M, state.node_of_E, 4)
    assert np.isclose(exp, (brute + 500) * 0.75 / 500)


def test_synth_controls():
    flat = synth_trace(num_experts=32, top_k=2, num_tokens=4000, gini=0.0, clustering=0.0, seed=0)
    skew = synth_trace(num_experts=32, top_k=2, num_tokens=4000, gini=0.6, clustering=0.0, seed=0)
    lf, _ = count_routing(flat.experts_LTK[0], 32)
    ls, _ = count_routing(skew.experts_LTK[0], 32)
    assert gini(lf) < 0.1 < 0.4 < gini(ls)
    used = ls[ls > 0]
    assert gini(used, size=32 + 100) == pytest.approx(gini(np.concatenate([ls, np.zeros(100)])))  # the rest zeros
    for tr in (flat, skew):
        row_sets = topk_sets(tr.experts_LTK[0])
        assert (row_sets >= 0).all()  # K distinct experts per token
