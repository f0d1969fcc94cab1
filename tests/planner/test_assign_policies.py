"""Task assignment, policies and layout validity (numpy only)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ds_cobalt.planner.assign import assign_tasks, remote_nodes_per_token
from ds_cobalt.planner.layout import Layout, contiguous_layout, copy_link_load, cross_node_copies, layout_from_dict
from ds_cobalt.planner.migration import LinkModel, migration_worth_it
from ds_cobalt.planner.policies import POLICIES, plan_layout
from ds_cobalt.planner.stage1 import plan_nodes, relabel_to_current
from ds_cobalt.planner.stats import RoutingStats
from ds_cobalt.planner.trace import Trace
from ds_cobalt.sim.metrics import simulate
from ds_cobalt.sim.replay import replay
from ds_cobalt.sim.synth import synth_trace


def _min_remote_nodes(row, src_node, holds_NE):
    """Brute force: fewest remote nodes covering the token's non-local experts."""
    need = [e for e in set(row.tolist()) if e >= 0 and not holds_NE[src_node, e]]
    if not need:
        return 0
    others = [n for n in range(holds_NE.shape[0]) if n != src_node]
    for size in range(1, len(others) + 1):
        for combo in itertools.combinations(others, size):
            if all(holds_NE[list(combo), e].any() for e in need):
                return size
    raise AssertionError("uncoverable")


def _random_replicated_layout(rng, E, N, G, R):
    """Owners contiguous, spare slots random distinct experts per rank."""
    W = N * G
    slots = np.full((W, E // W + R), -1, dtype=np.int64)
    slots[:, : E // W] = np.arange(E).reshape(W, E // W)
    for r in range(W):
        slots[r, E // W :] = rng.choice(np.setdiff1d(np.arange(E), slots[r, : E // W]), R, replace=False)
    return slots


@pytest.mark.parametrize("E, N, G, R, K, seed", [
    (8, 4, 1, 2, 4, 0), (8, 4, 2, 1, 3, 1), (12, 3, 2, 3, 5, 2), (16, 4, 2, 2, 6, 3), (6, 6, 1, 2, 4, 4),
])
def test_assignment_minimal_remote_nodes(E, N, G, R, K, seed):
    rng = np.random.default_rng(seed)
    slots = _random_replicated_layout(rng, E, N, G, R)
    T = 200
    topk = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    topk[rng.random((T, K)) < 0.1] = -1
    src = rng.integers(0, N * G, T)
    dest_rank, dest_slot = assign_tasks(topk, src, slots, G)
    lay = Layout(E, N, G, slots[None])
    holds_NE = lay.node_holds(0)
    # Dropped ids stay -1; every other pair lands on a slot holding its expert.
    assert ((topk < 0) == (dest_rank < 0)).all() and ((topk < 0) == (dest_slot < 0)).all()
    ok = topk >= 0
    assert (slots[dest_rank[ok], dest_slot[ok]] == topk[ok]).all()
    remote = remote_nodes_per_token(dest_rank, src, G)
    for t in range(T):
        # Each remote node visited once (counted as a set), own-node experts served locally.
        nodes_t = {int(r) // G for r in dest_rank[t] if r >= 0}
        assert remote[t] == len(nodes_t - {int(src[t]) // G})
        for k in range(K):
            if topk[t, k] >= 0 and holds_NE[src[t] // G, topk[t, k]]:
                assert dest_rank[t, k] // G == src[t] // G
        assert remote[t] == _min_remote_nodes(topk[t], int(src[t]) // G, holds_NE)


def test_assignment_greedy_trap_is_exact():
    """Greedy set cover would pick the node covering 4 experts and then need 2 more; optimum is 2."""
    # Nodes (G=1): 0 = source; 1 holds {0,1,2}; 2 holds {3,4,5}; 3 holds {0,1,3,4} (+ filler).
    slots = np.array([[6, 7, 8, 9], [0, 1, 2, 10], [3, 4, 5, 11], [0, 1, 3, 4]])
    topk = np.array([[0, 1, 2, 3, 4, 5]])
    dest, _ = assign_tasks(topk, np.array([0]), slots, 1)
    assert remote_nodes_per_token(dest, np.array([0]), 1)[0] == 2


def test_assignment_balances_replicas():
    # One node, 2 GPUs, both hold expert 0: its tokens split evenly.
    slots = np.array([[0, 1], [2, 0]])
    topk = np.zeros((100, 1), dtype=np.int64)
    dest, _ = assign_tasks(topk, np.zeros(100, np.int64), slots, 2)
    assert np.bincount(dest[:, 0], minlength=2).tolist() == [50, 50]


def test_assignment_degenerate():
    slots = np.arange(4).reshape(4, 1)
    dest, slot = assign_tasks(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), slots, 2)
    assert dest.shape == (0, 2) and slot.shape == (0, 2)
    dest, _ = assign_tasks(np.full((3, 1), -1), np.zeros(3, np.int64), slots, 2)
    assert (dest == -1).all()
    with pytest.raises(ValueError, match="held by no slot"):
        assign_tasks(np.array([[5]]), np.zeros(1, np.int64), slots, 2)
    with pytest.raises(ValueError, match="source_rank_T holds ranks"):
        assign_tasks(np.array([[1]]), np.array([9]), slots, 2)


SHAPES = [  # E, K, N, G, R, T
    (8, 2, 1, 2, 0, 100),     # one node
    (8, 2, 2, 4, 1, 100),     # one expert per GPU
    (16, 1, 2, 2, 1, 200),    # k = 1
    (32, 4, 4, 2, 2, 300),
    (16, 4, 2, 2, 1, 0),      # empty trace
]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("E, K, N, G, R, T", SHAPES)
def test_policy_layouts_valid(policy, E, K, N, G, R, T):
    tr = synth_trace(num_experts=E, top_k=K, num_tokens=T, num_layers=2, seed=E + T)
    if T:
        # Some experts never chosen.
        ex = tr.experts_LTK.copy()
        ex[ex == E - 1] = 0 if K == 1 else -1
        tr = Trace(ex, E)
    lay = plan_layout(tr, N, G, R, policy)
    W = N * G
    assert lay.slots_LWS.shape == (2, W, E // W + R)
    for layer in range(2):
        owners = lay.slots_LWS[layer, :, : E // W].reshape(-1)
        assert sorted(owners.tolist()) == list(range(E))  # owner convention
        for r in range(W):  # no rank holds two copies of an expert
            held = lay.slots_LWS[layer, r][lay.slots_LWS[layer, r] >= 0]
            assert held.size == np.unique(held).size
    report = simulate(tr, lay)
    assert set(report["mean"]) >= {"cross_node_tokens_per_token", "gpu_load_max_over_mean"}
    if N == 1:
        assert report["mean"]["cross_node_tokens_per_token"] == 0


def test_cobalt_beats_deepspeed_and_stage1_keeps_experts():
    tr = synth_trace(num_experts=32, top_k=4, num_tokens=3000, gini=0.3, clustering=0.7, seed=2)
    ds = simulate(tr, plan_layout(tr, 4, 2, 0, "deepspeed"))["mean"]["cross_node_tokens_per_token"]
    co = simulate(tr, plan_layout(tr, 4, 2, 0, "cobalt"))["mean"]["cross_node_tokens_per_token"]
    assert co < 0.9 * ds
    st = RoutingStats.from_topk(tr.experts_LTK[0], 32)
    first = plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 4)
    # Relabelling a permuted copy of the same partition recovers it exactly.
    perm = np.array([2, 0, 3, 1])
    assert np.array_equal(relabel_to_current(perm[first], first, 4), first)
    again = plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 4, current_node_of_E=first)
    assert (again == first).mean() >= 0.75


def test_plan_layout_prices_traffic_copies():
    """`plan_layout(copy_cost=...)`: free copies fill spare slots on other nodes than their owners' where they cut
    traffic; copies that cost more than any token they save are left out."""
    trace = synth_trace(num_experts=16, top_k=2, num_tokens=4000, gini=0.3, clustering=0.6, seed=0)

    def copies(cost: float) -> int:
        return int(cross_node_copies(plan_layout(trace, 4, 2, 1, "cobalt", copy_cost=cost).layer(0), 16, 2).sum())

    assert copies(0.0) > 0 and copies(10.0) == 0


def test_copy_link_load_prices_copies_as_the_busiest_link_carries_them():
    """Copies spread one per GPU count once each; one owner's expert copied to every other node is priced by that
    owner's link, which sends them one after another; with one link per node only the nodes' sums count."""
    E, G = 8, 2  # 2 nodes x 2 GPUs, two owner slots and one spare slot each
    spread = np.array([[0, 1, 4], [2, 3, 6], [4, 5, 0], [6, 7, 2]])  # each GPU sends one copy and holds one
    assert cross_node_copies(spread, E, G).sum() == 4 and copy_link_load(spread, E, G) == 4.0
    one_owner = np.array([[0, 1, 4], [2, 3, 4], [4, 5, -1], [6, 7, -1]])  # rank 2 sends expert 4 twice
    assert cross_node_copies(one_owner, E, G).sum() == 2
    assert copy_link_load(one_owner, E, G) == 8.0  # W x 2: a NIC per GPU
    assert copy_link_load(one_owner, E, G, gpu_link_share=1.0) == 4.0  # N x 2: the node's link
    assert copy_link_load(np.array([[0, 1, 2], [2, 3, 3], [4, 5, 6], [6, 7, -1]]), E, G) == 0.0  # same-node copies
    with pytest.raises(ValueError, match="gpu_link_share"):
        copy_link_load(spread, E, G, gpu_link_share=0.0)


def test_plan_prices_one_owners_copies_by_its_link():
    """Hot experts copied to every node (8 nodes): counted one by one the copies pay for themselves; priced by
    the owner's link, which sends each of them 7 times, they do not, and the plan keeps none. With one link per
    node (`copy_gpu_link_share=1`) they cost G = 2 times less and stay at a smaller price."""
    trace = synth_trace(num_experts=64, top_k=4, num_tokens=8000, gini=0.5, clustering=0.6, seed=1)

    def copies(cost: float, share: float | None) -> tuple[int, float]:
        slots = plan_layout(trace, 8, 2, 1, "cobalt", copy_cost=cost, copy_gpu_link_share=share).layer(0)
        return int(cross_node_copies(slots, 64, 2).sum()), copy_link_load(slots, 64, 2)

    free_count, free_load = copies(0.0, None)
    assert free_count > 0 and free_load > 2 * free_count  # the free plan's copies crowd onto a few owners
    assert copies(0.01, None)[0] == 0
    assert copies(0.01, 1.0)[0] > 0


def test_bad_topology_and_layout():
    tr = synth_trace(num_experts=16, top_k=2, num_tokens=10)
    with pytest.raises(ValueError, match="3 x 2 = 6 does not divide num_experts=16"):
        plan_layout(tr, 3, 2)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        plan_layout(tr, 2, 2, policy="nope")
    # 16 experts on 4 GPUs: a GPU owns 4 and can hold at most the other 12 as well
    assert plan_layout(tr, 2, 2, 12, policy="load").slots_per_gpu == 16
    with pytest.raises(ValueError, match="redundant_slots=13: a rank holds at most .* = 12 experts besides its own"):
        plan_layout(tr, 2, 2, 13)
    good = contiguous_layout(16, 2, 2).to_json_dict()
    missing = dict(good, layers=[{"slots": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 0]]}])
    with pytest.raises(ValueError, match=r"missing expert\(s\) \[15\]"):
        layout_from_dict(missing)
    wrong = dict(good, layers=[{"slots": [[0, 1, 2], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]}])
    with pytest.raises(ValueError, match=r"slots\[0\] must have slots_per_gpu=4"):
        layout_from_dict(wrong)
    with pytest.raises(ValueError, match="num_experts=8 but the layout has 16"):
        simulate(synth_trace(num_experts=8, top_k=2, num_tokens=10), contiguous_layout(16, 2, 2))


def test_migration_cost_model():
    link = LinkModel(expert_params=1000, token_bytes=100, margin=1.0)
    # 1 expert = 14 kB; saving 0.1 tokens/token x 1000 tokens x 100 B x 4 x 10 steps = 400 kB.
    assert migration_worth_it(1, 1.0, 0.9, 1000, 10, link)
    assert not migration_worth_it(100, 1.0, 0.9, 1000, 10, link)
    assert not migration_worth_it(0, 1.0, 0.5, 1000, 10, link)


def test_replay_runs():
    tr = synth_trace(num_experts=16, top_k=2, num_tokens=800, num_layers=1, seed=1)
    lay = plan_layout(tr, 2, 2, 1, "deepspeed")
    rep = replay(tr, lay, steps=4, replan_interval=2)
    assert rep["replans"] == 1 and len(rep["layers"]) == 1
    assert rep["mean"]["cross_node_tokens_per_token"] <= simulate(tr, lay)["mean"]["cross_node_tokens_per_token"] + 1e-9
