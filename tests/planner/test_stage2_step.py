"""Stage 2 every step: the refill rule (planner/stage2.py), the runtime's split sizes (runtime/step_spares.py)
and the replay's stage 2 modes (sim/replay.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ds_cobalt.planner.layout import Layout, contiguous_layout
from ds_cobalt.planner.stage2 import _water_fill, refill_layout, refill_node, refillable_slots
from ds_cobalt.runtime.placement import rank_within_key
from ds_cobalt.runtime.step_spares import copy_of_routes, fill_step, node_spares
from ds_cobalt.sim.replay import replay
from ds_cobalt.sim.synth import synth_trace


def test_water_fill_is_the_lowest_integer_maximum() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        G = int(rng.integers(1, 5))
        base = rng.integers(0, 12, (1, G))
        member = rng.random((1, G)) < 0.6
        member[0, rng.integers(G)] = True
        load = rng.integers(0, 15, 1)
        share = _water_fill(base, member, load)
        assert share.sum() == load[0] and (share >= 0).all() and (share[~member] == 0).all()
        # brute force over every integer split among the members
        idx = np.nonzero(member[0])[0]
        best = min(max(base[0, idx] + np.array(split)) for split in itertools.product(range(load[0] + 1),
                                                                                      repeat=idx.size)
                   if sum(split) == load[0])
        assert (base + share)[0, idx].max() == best


def test_refill_moves_rows_off_the_hot_gpu() -> None:
    block = np.array([[0, 1, -1], [2, 3, -1]])
    free = np.array([[False, False, True], [False, False, True]])
    out, share = refill_node(block, free, np.array([30, 10, 10, 10]))
    # expert 0 gets a copy on GPU 1 and the loads even out at 30 / 30
    np.testing.assert_array_equal(out, [[0, 1, -1], [2, 3, 0]])
    np.testing.assert_array_equal(share, [[20, 10, 0], [10, 10, 10]])
    # a copy that cannot lower the largest load is not made
    out, _ = refill_node(block, free, np.array([10, 10, 10, 10]))
    assert (out[:, 2] == -1).all()
    # only eligible experts are copied
    out, _ = refill_node(block, free, np.array([30, 10, 10, 10]), eligible_E=np.array([False, True, True, True]))
    assert 0 not in out[:, 2]


def test_refill_rules_hold_on_random_nodes() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        G, O, R = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 3))
        E = 2 * G * O
        block = np.concatenate([rng.permutation(E)[: G * O].reshape(G, O),
                                np.where(rng.random((G, R)) < 0.3, rng.integers(0, E, (G, R)), -1)], 1)
        free = np.zeros(block.shape, dtype=bool)
        free[:, O:] = rng.random((G, R)) < 0.7
        load = rng.zipf(1.5, E).clip(max=400)
        out, share = refill_node(block, free, load)
        again = refill_node(block, free, load)
        assert np.array_equal(out, again[0]) and np.array_equal(share, again[1])  # deterministic
        assert (out[~free] == block[~free]).all()
        for g, slot in zip(*np.nonzero(free & (out >= 0))):  # a refilled copy is the GPU's only one
            assert (out[g] == out[g, slot]).sum() == 1
        held = np.unique(out[out >= 0])
        assert share.sum() == load[held].sum() and (share >= 0).all() and (share[out < 0] == 0).all()
        if (block[free] < 0).all():
            before = np.array([load[row[row >= 0]].sum() for row in np.where(free, -1, block)])
            assert share.sum(1).max() <= before.max()


def test_refillable_slots_keep_traffic_copies() -> None:
    slots = np.array([[0, 1, 2], [2, 3, -1], [4, 5, 0], [6, 7, 7]])  # 2 nodes x 2, E=8
    free = refillable_slots(slots, 2, 8)
    # rank 0 holds expert 2 (owned on node 0): refillable; rank 2 holds 0 (owned on node 0): a traffic copy
    np.testing.assert_array_equal(free[:, 2], [True, True, False, True])
    assert not free[:, :2].any()


@pytest.mark.parametrize("seed", range(4))
def test_fill_step_split_sizes_agree_across_the_node(seed: int) -> None:
    """Every rank of the node derives the same refill; relay sends and expert-rank receives match per slot, and
    the relays' per-route copy picks add up to the split sizes."""
    rng = np.random.default_rng(seed)
    N, G, E = 2, 3, 12
    W = N * G
    slots = np.concatenate([contiguous_layout(E, N, G).layer(0), np.full((W, 1), -1)], 1)
    counts_WE = rng.integers(0, 6, (W, E))
    counts_WE[:, np.arange(E) // (E // N) != 0] = 0  # node 0 serves only its own experts
    counts_WE[:, 0] += 20  # a hot expert
    relay_GE = counts_WE.reshape(N, G, E).sum(0)
    fills = [fill_step(node_spares(slots, G, E, r), relay_GE, r % G, torch.device("cpu")) for r in range(G)]
    assert all(np.array_equal(f.slots_WS, fills[0].slots_WS) for f in fills)
    assert 0 in fills[0].slots_WS[:G, -1]  # the hot expert got a copy
    send = np.array([f.send_GS for f in fills])  # [relay, local rank, slot]
    recv = np.array([f.recv_GS for f in fills])  # [expert rank, relay, slot]
    np.testing.assert_array_equal(send, recv.transpose(1, 0, 2))
    assert send.sum() == counts_WE.sum()
    for relay, fill in enumerate(fills):  # the routes this relay holds: from sources (n, relay)
        src = np.repeat(np.arange(N) * G + relay, counts_WE[np.arange(N) * G + relay].sum(1))
        expert = np.concatenate([np.repeat(np.arange(E), counts_WE[s]) for s in np.arange(N) * G + relay])
        src_R, expert_R = torch.as_tensor(src), torch.as_tensor(expert)
        order_R = rank_within_key(src_R * E + expert_R)
        local_R, slot_R = copy_of_routes(fill, torch.as_tensor(counts_WE), G, src_R, expert_R, order_R)
        picked = np.zeros((G, slots.shape[1]), dtype=np.int64)
        np.add.at(picked, (local_R.numpy(), slot_R.numpy()), 1)
        np.testing.assert_array_equal(picked, fill.send_GS)
        # each route goes to a slot holding its expert
        assert (fill.slots_WS[local_R.numpy(), slot_R.numpy()] == expert).all()


def test_replay_stage2_modes() -> None:
    trace = synth_trace(num_experts=16, top_k=4, num_tokens=4096, num_layers=1, gini=0.5, seed=3)
    spare = np.concatenate([contiguous_layout(16, 2, 2).layer(0), np.full((4, 1), -1)], 1)
    layout = Layout(16, 2, 2, spare[None])
    reports = {m: replay(trace, layout, steps=4, replan_interval=100, stage2=m) for m in ("step", "interval")}
    # the interval keeps the empty spare slots; refilled every step the GPUs come closer to the node balance
    step, interval = reports["step"], reports["interval"]
    assert step["step_gpu_load_max_over_mean_median"] < interval["step_gpu_load_max_over_mean_median"]
    assert step["step_gpu_load_max_over_mean_median"] >= step["step_node_load_max_over_mean_median"] - 1e-9
    assert step["mean"]["cross_node_tokens_per_token"] == interval["mean"]["cross_node_tokens_per_token"]
    with pytest.raises(ValueError, match="stage2"):
        replay(trace, layout, steps=4, stage2="sometimes")
    # refill_layout refills every node with its own experts only
    out, share = refill_layout(spare, np.tile(np.arange(16), (2, 1)), 2, 16)
    assert set(out[:2, -1].tolist()) <= set(range(8)) | {-1} and set(out[2:, -1].tolist()) <= set(range(8, 16)) | {-1}
