"""Pure re-planning decisions: owner moves, slot alignment, keep/replicas/migrate, the migration cost model."""

from __future__ import annotations

import numpy as np

from ds_cobalt.planner import LinkModel, migration_worth_it
from ds_cobalt.planner.decisions import (
    KEEP,
    MIGRATE,
    REPLICAS,
    LayerStats,
    confirm_on_newer_routing,
    plan_layer_decision,
    remote_nodes_of,
)
from ds_cobalt.planner.migration import migration_bytes
from ds_cobalt.planner.owner_moves import align_owner_slots, plan_owner_moves
from ds_cobalt.planner.stage2 import fill_spares
from ds_cobalt.planner.stats import count_routing

E = 8


def random_owner_layout(rng: np.random.Generator, world: int = 4) -> np.ndarray:
    return rng.permutation(E).reshape(world, E // world)


def test_plan_owner_moves_orders_match() -> None:
    rng = np.random.default_rng(0)
    old, new = random_owner_layout(rng), random_owner_layout(rng)
    plans = [plan_owner_moves(old, new, 2, r) for r in range(4)]
    # what r sends to q, in order, is what q receives from r, in order
    for r in range(4):
        for q in range(4):
            sent = [old[r, s] for s in plans[r].send_slot[sum(plans[r].send_splits[:q]):][:plans[r].send_splits[q]]]
            got = [new[q, s] for s in plans[q].recv_slot[sum(plans[q].recv_splits[:r]):][:plans[q].recv_splits[r]]]
            assert sent == got
    moved = {e for plan in plans for e, _, _ in plan.moved}
    assert moved == {e for e in range(E) if tuple(np.argwhere(old == e)[0]) != tuple(np.argwhere(new == e)[0])}
    assert plan_owner_moves(old, old, 2, 0).empty


def test_align_owner_slots_keeps_staying_experts_in_place() -> None:
    current = np.array([[0, 1], [2, 3]])
    new = np.array([[1, 2], [3, 0]])  # 1 stays on rank 0, 3 on rank 1
    aligned = align_owner_slots(current, new, 2)
    assert aligned[0, 1] == 1 and aligned[1, 1] == 3
    assert sorted(aligned[0]) == [1, 2] and sorted(aligned[1]) == [0, 3]
    assert np.array_equal(align_owner_slots(current, current, 2), current)


def _paired_stats() -> LayerStats:
    # Tokens choose pairs {0, 7}, {1, 6}, ... that the contiguous layout splits across nodes.
    rng = np.random.default_rng(0)
    pair = rng.integers(0, 4, size=4000)
    topk = np.stack([pair, 7 - pair], axis=1)
    src = rng.integers(0, 4, size=4000)
    load, coact = count_routing(topk, E)
    return LayerStats(load.astype(float), coact.astype(float), 4000, topk, src)


COMMON = dict(nodes=2, gpus_per_node=2, policy="cobalt", seed=0, interval=100, tokens_per_step=4000.0)


def test_plan_layer_decision_follows_cost_model() -> None:
    stats, current = _paired_stats(), np.arange(E).reshape(4, 2)
    cheap = plan_layer_decision(stats, current, link=LinkModel(expert_params=100, token_bytes=64),
                                redundant_slots=0, ignore_cost_model=False, **COMMON)
    assert cheap.action == MIGRATE and cheap.new_cross < cheap.old_cross and cheap.saving_s > 0
    dear = plan_layer_decision(stats, current, link=LinkModel(expert_params=10 ** 9, token_bytes=64),
                               redundant_slots=0, ignore_cost_model=False, **COMMON)
    assert dear.action == KEEP and np.array_equal(dear.slots_WS, current) and dear.saving_s < 0
    forced = plan_layer_decision(stats, current, link=LinkModel(expert_params=10 ** 9, token_bytes=64),
                                 redundant_slots=0, ignore_cost_model=True, **COMMON)
    assert forced.action == MIGRATE


def test_owner_moves_refused_still_plan_the_spare_slots() -> None:
    """Migration too dear: the owners stay where they are and the spare slots still get replicas (free);
    the pairs split across nodes get per-node traffic copies, and the sample crosses less than before."""
    stats, current = _paired_stats(), np.arange(E).reshape(4, 2)
    # small experts (their copies cost little a step) with an optimizer state too dear to move
    dear = plan_layer_decision(stats, current, link=DEAR_STATE, redundant_slots=1, ignore_cost_model=False, **COMMON)
    assert dear.action == REPLICAS and dear.slots_WS.shape == (4, 3)
    assert np.array_equal(dear.slots_WS[:, :2], current)  # no owner moved
    assert (dear.slots_WS[:, 2] >= 0).all() and dear.new_cross < dear.old_cross
    for rank, row in enumerate(dear.slots_WS):  # a spare copy never repeats an expert on its rank
        assert len(set(row.tolist())) == 3, (rank, row)


DEAR_STATE = LinkModel(expert_params=100, token_bytes=64, optimizer_bytes_per_param=10 ** 9)


def test_traffic_copies_are_priced_by_their_weights() -> None:
    """A traffic copy's weights cross the link every step: where they cost more than the tokens it keeps on the
    node, the plan leaves it out. Same routing and owners as above, experts of 100 against 10^6 parameters."""
    from ds_cobalt.planner.layout import cross_node_copies
    from ds_cobalt.planner.migration import copy_cost_per_token

    stats, current = _paired_stats(), np.arange(E).reshape(4, 2)
    heavy = LinkModel(expert_params=10 ** 6, token_bytes=64, optimizer_bytes_per_param=10 ** 9)
    # 10^6 x 2 bytes out and back against 4 x 64 bytes per cross-node token: 7812 tokens of 4000 a step
    assert copy_cost_per_token(heavy, 4000.0) == 2 * 10 ** 6 * 2 / (4 * 64) / 4000
    light = plan_layer_decision(stats, current, link=DEAR_STATE, redundant_slots=1, ignore_cost_model=False,
                                **COMMON)
    dear = plan_layer_decision(stats, current, link=heavy, redundant_slots=1, ignore_cost_model=False, **COMMON)
    assert cross_node_copies(light.slots_WS, E, 2).sum() > 0
    assert cross_node_copies(dear.slots_WS, E, 2).sum() == 0
    assert np.array_equal(dear.slots_WS[:, :2], current)  # no owner moved either


def test_fill_spares_keeps_owners_and_balances_copies() -> None:
    owner_WP = np.array([[0, 1], [2, 3]])
    load_NE = np.array([[10.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    extra_NE = np.array([[False, False, False, False, True, False]])  # one cross-node copy: expert 4
    slots = fill_spares(owner_WP, load_NE, extra_NE, gpus_per_node=2, redundant_slots=1)
    assert np.array_equal(slots[:, :2], owner_WP)
    # the copy of 4 takes one spare slot; the other goes to the hottest expert (0), on the other rank
    assert sorted(slots[:, 2].tolist()) == [0, 4] and slots[1, 2] == 0


def test_one_migration_formula() -> None:
    link = LinkModel(expert_params=1000, token_bytes=64, margin=1.5)
    saved, cost = migration_bytes(3, 1.0, 0.5, 1000, 10, link)
    assert saved == 0.5 * 1000 * 64 * 4 * 10 and cost == 3 * link.expert_bytes
    assert migration_worth_it(3, 1.0, 0.5, 1000, 10, link) == (saved > 1.5 * cost)
    assert not migration_worth_it(0, 1.0, 0.0, 1000, 10, link)


def _rows(pairs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Tokens choosing the expert pairs `pairs` [M, 2] uniformly, from random ranks."""
    topk = pairs[rng.integers(0, len(pairs), size=4000)]
    return topk, rng.integers(0, 4, size=4000)


def test_confirm_on_newer_routing_keeps_the_layout_where_the_routing_moved_on() -> None:
    """A plan that co-locates the pairs of its sample: confirmed on newer rows with the same pairs; turned into
    KEEP where the newer rows pair the experts differently (the plan is worse there), and where the gain on them is
    within the noise of the rows; a check without rows leaves the action alone."""
    rng = np.random.default_rng(0)
    current = np.arange(E).reshape(4, 2)  # nodes {0..3} and {4..7}
    planned = np.array([[0, 7], [1, 6], [2, 5], [3, 4]])  # nodes {0, 1, 6, 7} and {2..5}
    link = LinkModel(expert_params=100, token_bytes=64)
    common = dict(num_experts=E, link=link, interval=100, tokens_per_step=4000.0, gpus_per_node=2)

    def confirm(action: int, slots: np.ndarray, rows: tuple, **kw):
        old_T, new_T = (remote_nodes_of(*rows, layout, 2) for layout in (current, slots))
        return confirm_on_newer_routing(action, slots, current, old_T, new_T, **{**common, **kw})

    same = _rows(np.array([[p, 7 - p] for p in range(4)]), rng)
    held = confirm(MIGRATE, planned, same)
    assert held.action == MIGRATE and held.new_cross < held.old_cross and held.gain_low > 0
    moved_on = _rows(np.array([[0, 2], [1, 3], [4, 6], [5, 7]]), rng)  # pairs only the current layout keeps local
    gone = confirm(MIGRATE, planned, moved_on)
    assert gone.action == KEEP and gone.new_cross > gone.old_cross
    assert confirm(REPLICAS, planned, moved_on).action == KEEP
    assert confirm(REPLICAS, current, moved_on).action == REPLICAS
    # half the tokens favour each layout: no gain beyond the noise, so no migration
    mixed = _rows(np.array([[0, 7], [1, 6], [2, 5], [3, 4], [0, 2], [1, 3], [4, 6], [5, 7]]), rng)
    assert confirm(MIGRATE, planned, mixed).action == KEEP
    # a dear migration is refused on the same rows that confirm a cheap one
    assert confirm(MIGRATE, planned, same, link=LinkModel(expert_params=10 ** 9, token_bytes=64)).action == KEEP
    none = np.zeros(0, dtype=np.int64)
    assert confirm_on_newer_routing(MIGRATE, planned, current, none, none, **common).action == MIGRATE


def _copy_confirmer(holders: list[int], source_T: np.ndarray):
    """`confirm(expert_params)`: the action `confirm_on_newer_routing` leaves to a replica-only change that copies
    expert 0 (owned by rank 0, node 0) onto `holders` (ranks of node 1), on newer rows from `source_T` of which a
    tenth also choose expert 0 (0.1 cross-node tokens per token saved)."""
    current = np.concatenate([np.arange(E).reshape(4, 2), np.full((4, 1), -1)], axis=1)
    copied = current.copy()
    copied[holders, 2] = 0
    topk = np.tile([4, 5], (source_T.size, 1))
    topk[::10, 0] = 0
    old_T, new_T = (remote_nodes_of(topk, source_T, layout, 2) for layout in (current, copied))
    assert abs(old_T.mean() - 0.1) < 1e-12 and new_T.mean() == 0.0

    def confirm(expert_params: int) -> int:
        return confirm_on_newer_routing(REPLICAS, copied, current, old_T, new_T, num_experts=E,
                                        link=LinkModel(expert_params=expert_params, token_bytes=64), interval=100,
                                        tokens_per_step=4000.0, gpus_per_node=2).action

    return confirm


def test_replica_change_is_confirmed_only_where_its_traffic_copies_pay() -> None:
    """A replica-only change that adds a traffic copy (expert 0 of node 0 held on node 1) stands on newer rows only
    where the cross-node tokens it saves there outweigh the copy's weights crossing every step."""
    confirm = _copy_confirmer([2], np.full(4000, 2))
    assert confirm(100) == REPLICAS  # the copy costs ~0.0016 cross-node tokens per token (W x 1 copy)
    assert confirm(10 ** 6) == KEEP  # ~15.6: more than the tenth it saves


def test_copies_from_one_owner_are_priced_by_its_link() -> None:
    """Expert 0 (rank 0) copied to both ranks of node 1: its owner sends both copies one after another, so the
    change is priced as the busiest link carries it (W x 2 copies with a NIC per GPU), not as two copies on
    links of their own. At 6400 parameters two copies would cost 0.05 cross-node tokens per token against the 0.1
    they save; on rank 0's link they cost 0.2."""
    confirm = _copy_confirmer([2, 3], np.repeat([2, 3], 2000))
    assert confirm(1600) == REPLICAS  # 0.05 on rank 0's link
    assert confirm(6400) == KEEP


def test_replan_seeds_stage1_without_kahypar(monkeypatch) -> None:
    """A re-plan (`plan_layer_decision`) seeds stage 1 with `plan_nodes`' "fast" seeds; offline planning
    (`plan_layout`) still runs Mt-KaHyPar where it is installed."""
    import ds_cobalt.planner.stage1 as stage1
    from ds_cobalt.planner.policies import plan_layout
    from ds_cobalt.planner.trace import Trace

    partitioners: list[str] = []
    plan_nodes = stage1.plan_nodes

    def recorded(*args, **kwargs):
        partitioners.append(kwargs["partitioner"])
        return plan_nodes(*args, **kwargs)

    monkeypatch.setattr("ds_cobalt.planner.policies.plan_nodes", recorded)
    stats = _paired_stats()
    current = np.concatenate([np.arange(E).reshape(4, 2), np.full((4, 1), -1)], axis=1)
    plan_layer_decision(stats, current, link=LinkModel(expert_params=100, token_bytes=64), redundant_slots=1,
                        ignore_cost_model=False, **COMMON)
    assert partitioners and set(partitioners) == {"fast"}
    partitioners.clear()
    plan_layout(Trace(stats.samples_TK[None], E), 2, 2, 1)
    assert "auto" in partitioners
