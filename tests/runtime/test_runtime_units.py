"""Single-process tests of the runtime pieces: task assignment, statistics, topology, config, imports."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import torch

from ds_cobalt.config import parse_cobalt_config, split_deepspeed_config
from ds_cobalt.planner.assign import assign_tasks as assign_numpy
from ds_cobalt.planner.assign import remote_nodes_per_token
from ds_cobalt.planner.layout import contiguous_layout
from ds_cobalt.planner.stats import count_routing
from ds_cobalt.runtime.placement import assign_tasks, build_placement
from ds_cobalt.runtime.stats import DeviceRoutingStats
from ds_cobalt.runtime.topology import Topology, detect_ranks_per_node


def _random_layout(rng, E: int, N: int, G: int, spare: int) -> np.ndarray:
    """Owners: a random permutation; spare slots: random experts (may repeat, may be -1)."""
    W = N * G
    owners = rng.permutation(E).reshape(W, E // W)
    extra = rng.integers(-1, E, size=(W, spare))
    return np.concatenate([owners, extra], axis=1)


@pytest.mark.parametrize("N,G,E,K,spare", [(1, 4, 8, 2, 0), (2, 2, 8, 2, 1), (4, 2, 16, 4, 2), (3, 1, 6, 1, 1),
                                            (2, 2, 4, 2, 0)])
def test_assignment_is_valid_and_minimal_like_the_planner(N: int, G: int, E: int, K: int, spare: int) -> None:
    rng = np.random.default_rng(N * 100 + E)
    slots = _random_layout(rng, E, N, G, spare)
    T = 400
    topk = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
    topk[rng.random((T, K)) < 0.1] = -1  # dropped routes
    placement = build_placement(slots, G, E)
    for src in range(N * G):
        rank_TK, slot_TK = (a.numpy() for a in assign_tasks(torch.from_numpy(topk), placement, src))
        valid = topk >= 0
        assert ((rank_TK >= 0) == valid).all() and ((slot_TK >= 0) == valid).all()
        assert (slots[rank_TK[valid], slot_TK[valid]] == topk[valid]).all()  # the chosen slot holds the expert
        own_node_holds = np.isin(topk, slots[src // G * G:(src // G + 1) * G])
        assert (rank_TK[valid & own_node_holds] // G == src // G).all()  # own node first
        ours = remote_nodes_per_token(rank_TK, np.full(T, src), G)
        ref_rank, _ = assign_numpy(topk, np.full(T, src), slots, G)
        spec = remote_nodes_per_token(ref_rank, np.full(T, src), G)
        if spare == 0:
            assert (ours == spec).all()  # no replicas: nodes are forced
        else:
            assert ours.sum() <= 1.02 * spec.sum()  # greedy cover vs the planner's exact minimum


def test_replicas_share_an_experts_tokens() -> None:
    # expert 0 held by both ranks of node 0: its tokens split evenly between them
    slots = np.array([[0, -1], [1, 0], [2, 0], [3, -1]])  # a copy of 0 on rank 1 (node 0) and rank 2 (node 1)
    placement = build_placement(slots, 2, 4)
    topk = torch.zeros((100, 1), dtype=torch.long)
    rank_TK, _ = assign_tasks(topk, placement, src_rank=0)
    assert np.bincount(rank_TK.numpy().ravel(), minlength=4).tolist() == [50, 50, 0, 0]


def test_device_stats_match_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    E, K = 12, 3
    stats = DeviceRoutingStats(E, K, sample_tokens=50)
    chunks = [rng.integers(-1, E, size=(T, K)) for T in (30, 0, 41)]
    for chunk in chunks:
        stats.update(torch.from_numpy(chunk))
    load, coact, sample = stats.snapshot()
    ref_load, ref_coact = count_routing(np.concatenate(chunks), E)
    np.testing.assert_array_equal(load, ref_load)
    np.testing.assert_array_equal(coact, ref_coact)
    np.testing.assert_array_equal(sample, np.concatenate(chunks)[-50:])  # the latest rows, oldest first
    np.testing.assert_array_equal(stats.recent_rows(7), np.concatenate(chunks)[-7:])
    distinct = np.stack([rng.permutation(E)[:K] for _ in range(20)])  # a router picks an expert once per token
    stats.update(torch.from_numpy(distinct), planned=False)  # a layer left out of re-plans: load only
    load2, coact2, sample2 = stats.snapshot()
    np.testing.assert_array_equal(load2, ref_load + count_routing(distinct, E)[0])
    np.testing.assert_array_equal(coact2, ref_coact)
    np.testing.assert_array_equal(sample2, sample)
    stats.reset()  # the host copies outlive the buffers (a CPU tensor's numpy() would share them)
    np.testing.assert_array_equal(load2, ref_load + count_routing(distinct, E)[0])
    assert stats.recent_rows().shape == (0, K)


def test_topology_detection_and_errors() -> None:
    assert detect_ranks_per_node(8, env={"LOCAL_WORLD_SIZE": "4"}) == 4
    # the deepspeed launcher's LOCAL_SIZE wins over the LOCAL_WORLD_SIZE=1 that accelerate writes on CPU
    assert detect_ranks_per_node(8, env={"LOCAL_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1"}, rank=1) == 4
    assert detect_ranks_per_node(8, env={"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert detect_ranks_per_node(8, override=2, env={"LOCAL_WORLD_SIZE": "8"}) == 2
    assert detect_ranks_per_node(6, env={}) == 6
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by cobalt.topology.ranks_per_node=4"):
        detect_ranks_per_node(6, override=4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4"):
        detect_ranks_per_node(6, env={"LOCAL_WORLD_SIZE": "4"})
    assert detect_ranks_per_node(8, env={"LOCAL_SIZE": "2", "LOCAL_RANK": "1"}, rank=3) == 2  # deepspeed's pdsh runner
    with pytest.raises(ValueError, match="consecutive"):  # mpirun --map-by node: rank 1 on the second node
        detect_ranks_per_node(8, env={"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, rank=1)
    assert detect_ranks_per_node(8, override=2, env={"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}, rank=3) == 2
    topo = Topology(world_size=8, ranks_per_node=4, rank=6)
    assert (topo.nodes, topo.node, topo.local_rank) == (2, 1, 2)
    with pytest.raises(ValueError, match="not divisible by ranks_per_node=3"):
        Topology(world_size=8, ranks_per_node=3, rank=0)


@pytest.mark.parametrize("section,message", [
    ({"topolgy": {}}, r"cobalt\.topolgy: unknown key"),
    ({"topology": {"ranks_per_node": 0}}, r"cobalt\.topology\.ranks_per_node: Input should be greater than 0"),
    ({"topology": {"ranks_per_node": "2"}}, r"cobalt\.topology\.ranks_per_node: Input should be a valid integer"),
    ({"topology": {"group_timeout_s": 0}}, r"cobalt\.topology\.group_timeout_s: Input should be greater than 0"),
    ({"traffic": {"log_interval": -1}}, r"cobalt\.traffic\.log_interval"),
    ({"trace": {"steps": 0}}, r"cobalt\.trace\.steps"),
    ([1], r"cobalt: expected an object"),
    # a wait past threading.TIMEOUT_MAX failed the re-plan at its apply step (OverflowError); NaN and inf are not
    # times or link rates; a plan from no rows would move owners on nothing
    ({"planner": {"plan_timeout_s": 1e10}}, r"cobalt\.planner\.plan_timeout_s: .*less than or equal to 604800"),
    ({"topology": {"group_timeout_s": float("nan")}}, r"cobalt\.topology\.group_timeout_s: .*finite number"),
    ({"migration": {"inter_node_gbps": float("inf")}}, r"cobalt\.migration\.inter_node_gbps: .*finite number"),
    ({"planner": {"sample_tokens": 0}}, r"cobalt\.planner\.sample_tokens: .*greater than or equal to 1"),
])
def test_bad_config_names_the_key(section, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cobalt_config(section)


def test_config_split_keeps_deepspeed_keys(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "cobalt": {"topology": {"ranks_per_node": 2}}}')
    ds, cobalt = split_deepspeed_config(path)
    assert ds == {"train_batch_size": 8} and cobalt.topology.ranks_per_node == 2
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        split_deepspeed_config(path)
    # as DeepSpeed reads a config: comments allowed (hjson), a duplicate key is an error, base64 strings too
    path.write_text('{\n  // micro batches\n  "train_batch_size": 8,\n  "cobalt": {}\n}')
    assert split_deepspeed_config(path)[0] == {"train_batch_size": 8}
    path.write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="Duplicate keys"):
        split_deepspeed_config(path)
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "cobalt": {"planner": {"replan_interval": 7}}}')
    ds, cobalt = split_deepspeed_config(encoded.decode())
    assert ds == {"train_batch_size": 8} and cobalt.planner.replan_interval == 7
    # a misspelled section would be ignored by DeepSpeed and run the defaults silently
    for key in ("Cobalt", "ds_cobalt", "COBALT "):
        with pytest.raises(ValueError, match=f"DeepSpeed config key '{key}': the ds_cobalt section is spelled"):
            split_deepspeed_config({"train_batch_size": 8, key: {"planner": {"replan_interval": 7}}})
    with pytest.raises(ValueError, match="existing config file"):
        split_deepspeed_config(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="group_timeout_s"):
        parse_cobalt_config({"topology": {"group_timeout_s": float("inf")}})
    with pytest.raises(ValueError, match="cobalt.trace.path"):
        parse_cobalt_config({"trace": {"path": ""}})


def test_layout_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        contiguous_layout(6, 2, 2)
    slots = contiguous_layout(8, 2, 2).layer(0).copy()
    slots[1, 0] = 0  # expert 0 owned twice, expert 2 nowhere among owners
    with pytest.raises(ValueError, match="owner slots"):
        build_placement(slots, 2, 8)


def test_moe_rejects_bad_arguments() -> None:
    import ds_cobalt

    expert = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        ds_cobalt.MoE(4, expert, num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match="use_tutel"):
        ds_cobalt.MoE(4, expert, num_experts=4, use_tutel=True)


def test_single_rank_layer_runs_without_process_groups() -> None:
    import ds_cobalt

    torch.manual_seed(0)
    layer = ds_cobalt.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=1, k=2)
    x = torch.randn(10, 8, requires_grad=True)
    out, l_aux, counts = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and int(counts.sum()) == 20 and x.grad is not None


def test_tile_tuner_walks_candidates_then_keeps_the_fastest(monkeypatch) -> None:
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    tuner = tile_tuner.TileTuner(factors=(0.5, 1.0, 2.0), warmup=1)
    row_bytes = 1024 * 4
    guess = tile_tuner.guess_tile_rows(row_bytes)
    assert guess == 64
    fake_seconds = {32: 3.0, 64: 1.0, 128: 2.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    seen = []
    for _ in range(6):
        rows = tuner.tile_rows(row_bytes)
        seen.append(rows)
        started = tuner.start(torch.device("cpu"))
        now["t"] += fake_seconds[rows]  # the forward "takes" this long
        tuner.record(started, torch.device("cpu"), groups)
    assert seen[:4] == [32, 32, 64, 128]  # warm-up, then each candidate once
    assert tuner.chosen == 64 and seen[4:] == [64, 64]


def test_overlap_config_validates_tile_rows() -> None:
    assert parse_cobalt_config({"overlap": {"enabled": True}}).overlap.tile_rows == "auto"
    assert parse_cobalt_config({"overlap": {"tile_rows": 64}}).overlap.tile_rows == 64
    with pytest.raises(ValueError, match=r"cobalt\.overlap\.tile_rows"):
        parse_cobalt_config({"overlap": {"tile_rows": 0}})
    with pytest.raises(ValueError, match=r"cobalt\.overlap\.tile_rows"):
        parse_cobalt_config({"overlap": {"tile_rows": "fast"}})


def test_overlap_tuner_settles_tiles_then_rail_chunks(monkeypatch) -> None:
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    tuner = tile_tuner.OverlapTuner()
    tuner.tiles = tile_tuner.TileTuner(factors=(1.0, 2.0), warmup=0)
    tuner.chunks = tile_tuner.ChoiceTuner((1, 2, 4), warmup=0)
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    cost = {64: 2.0, 128: 1.0}  # tile rows -> seconds; rail chunks add 4 -> 0.5, 2 -> 0.1, 1 -> 0.3
    extra = {1: 0.3, 2: 0.1, 4: 0.5}
    seen = []
    tuner.mode = tile_tuner.ChoiceTuner((1, 0), warmup=0)
    phased_seconds = 1.05  # faster than the best overlapped forward (128 tile rows, 2 chunks: 1.1)
    seen = []
    for _ in range(9):
        choice = tuner.settings(4096, "auto", "auto", "auto")
        seen.append((choice.overlap, choice.tile_rows, choice.rail_chunks))
        timed = choice.timed
        started = timed.start(torch.device("cpu")) if timed else None
        now["t"] += cost[choice.tile_rows] + extra[choice.rail_chunks] if choice.overlap else phased_seconds
        if timed:
            timed.record(started, torch.device("cpu"), groups)
    # tiles timed with the chunk guess, then chunks with the chosen tile size, then overlapped vs phased
    assert seen[:7] == [(True, 64, 2), (True, 128, 2), (True, 128, 1), (True, 128, 2), (True, 128, 4),
                        (True, 128, 2), (False, 128, 2)]
    assert tuner.chosen() == {"tile_rows": 128, "rail_chunks": 2, "overlap": 0}  # phased won: 1.05 < 1.1
    assert seen[7:] == [(False, 128, 2)] * 2
    # fixed settings are passed through and nothing is timed
    fixed = tile_tuner.OverlapTuner().settings(4096, 32, 3)
    assert (fixed.overlap, fixed.tile_rows, fixed.rail_chunks, fixed.timed) == (True, 32, 3, None)


def test_overlap_config_validates_rail_chunks() -> None:
    assert parse_cobalt_config({"overlap": {"enabled": "auto"}}).overlap.enabled == "auto"
    with pytest.raises(ValueError, match=r"cobalt\.overlap\.enabled"):
        parse_cobalt_config({"overlap": {"enabled": "sometimes"}})
    assert parse_cobalt_config({}).overlap.rail_chunks == 2
    assert parse_cobalt_config({"overlap": {"rail_chunks": "auto"}}).overlap.rail_chunks == "auto"
    for bad in (0, 65, "many"):
        with pytest.raises(ValueError, match=r"cobalt\.overlap\.rail_chunks"):
            parse_cobalt_config({"overlap": {"rail_chunks": bad}})


def test_step_timed_choice_alternates_then_keeps_the_lower_median(monkeypatch) -> None:
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = tile_tuner.StepTimedChoice(["hierarchical", "direct"], repeats=3, warmup=1)
    cost = {"hierarchical": 2.0, "direct": 1.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    seen = []
    for _ in range(10):
        pick = chooser.pick(torch.device("cpu"), groups)
        seen.append(pick)
        now["t"] += cost[pick] + (5.0 if len(seen) == 4 else 0.0)  # one slow outlier step of "hierarchical"
    # a warm-up step, then rounds in rotated order: (hierarchical, direct), (direct, hierarchical), ...
    assert seen[:7] == ["hierarchical", "hierarchical", "direct", "direct", "hierarchical", "hierarchical", "direct"]
    assert chooser.chosen == "direct" and seen[7:] == ["direct"] * 3
    assert chooser.medians == {"hierarchical": 2.0, "direct": 1.0}  # the median ignores the outlier
    assert tile_tuner.StepTimedChoice(["hierarchical"]).chosen == "hierarchical"  # one candidate: no trials


def test_step_timed_choice_ends_trials_at_the_optimizer_step(monkeypatch) -> None:
    """With `step_end` the time between steps (another model's step, data loading) stays out of the trials."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = tile_tuner.StepTimedChoice(["hierarchical", "dense"], repeats=3, warmup=1)
    cost = {"hierarchical": 2.0, "dense": 1.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    for _ in range(9):
        pick = chooser.pick(torch.device("cpu"), groups)
        now["t"] += cost[pick]
        chooser.step_end(torch.device("cpu"))
        now["t"] += 10.0 if pick == "dense" else 0.0  # slow work after dense's steps: not dense's cost
    assert chooser.chosen == "dense" and chooser.medians == {"hierarchical": 2.0, "dense": 1.0}


@pytest.mark.parametrize("hierarchical_s,chosen", [(0.97, "dense"), (0.94, "hierarchical")])
def test_step_timed_choice_keeps_the_preferred_candidate_in_a_close_call(monkeypatch, hierarchical_s,
                                                                          chosen) -> None:
    """The preferred candidate (the layer's: dense) is replaced only by one faster by more than the margin."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import DENSE_MARGIN, SCHEDULE_WARMUP, LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["hierarchical", "dense"])
    assert (chooser.prefer, chooser.margin) == ("dense", DENSE_MARGIN) and DENSE_MARGIN == 0.05
    cost = {"hierarchical": hierarchical_s, "dense": 1.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    for _ in range(SCHEDULE_WARMUP + 2 * 3):
        now["t"] += cost[chooser.pick(torch.device("cpu"), groups)]
    assert chooser.chosen is None  # the trials: warm-up steps, then 3 rounds of both
    chooser.pick(torch.device("cpu"), groups)
    assert chooser.chosen == chosen and chooser.medians == pytest.approx({"hierarchical": hierarchical_s, "dense": 1.0})


@pytest.mark.parametrize("direct_predicted,direct_s,chosen", [
    (1.2, 0.94, "direct"),  # the model prices direct's communication below dense's: DENSE_MARGIN (5 %) is enough
    (2.5, 0.94, "dense"),  # it prices it above dense's: only DISPUTED_DENSE_MARGIN (30 %) faster replaces dense
    (2.5, 0.80, "dense"),
    (2.0, 0.80, "dense"),  # equal prices count as disputed
    (1.85, 0.80, "dense"),  # ... and so does a price 7.5 % below dense's (under CLEAR_SAVING: a close call)
    (1.6, 0.94, "direct"),  # 20 % below: a saving the model resolves
    (2.5, 0.65, "direct"),
])
def test_step_timed_choice_needs_a_clear_win_where_the_model_disagrees(monkeypatch, direct_predicted, direct_s,
                                                                       chosen) -> None:
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import CLEAR_SAVING, DENSE_MARGIN, DISPUTED_DENSE_MARGIN, LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    assert DENSE_MARGIN < 0.06 < 0.25 < DISPUTED_DENSE_MARGIN < 0.34 and 0.075 < CLEAR_SAVING < 0.2
    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["direct", "dense"])
    chooser.use_model({"direct": direct_predicted, "dense": 2.0}, [])
    cost = {"direct": direct_s, "dense": 1.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    while chooser.chosen is None:
        now["t"] += cost[chooser.pick(torch.device("cpu"), groups)]
    assert chooser.chosen == chosen and chooser.medians == pytest.approx(cost)


@pytest.mark.parametrize("hierarchical_predicted,direct_s,chosen", [
    (1.0, 0.97, "hierarchical"),  # the model prices hierarchical clearly below direct: a 3 % faster direct loses
    (1.0, 0.90, "hierarchical"),  # ... so does a 10 % faster one
    (1.0, 0.84, "direct"),  # ... and a 16 % faster one wins (FAVOURITE_MARGIN)
    (1.45, 0.97, "direct"),  # priced within CLEAR_SAVING of direct: the faster median wins
])
def test_step_timed_choice_keeps_the_models_clear_favourite_in_a_close_call(monkeypatch, hierarchical_predicted,
                                                                            direct_s, chosen) -> None:
    """Between candidates other than the preferred one (dense), the one the model prices CLEAR_SAVING below the
    fastest stays unless the fastest measured FAVOURITE_MARGIN faster; dense keeps its own rule."""
    from ds_cobalt.runtime.layer import FAVOURITE_MARGIN

    assert FAVOURITE_MARGIN == 0.15
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["hierarchical", "direct", "dense"])
    chooser.use_model({"hierarchical": hierarchical_predicted, "direct": 1.5, "dense": 2.0}, [])
    cost = {"hierarchical": 1.0, "direct": direct_s, "dense": 1.5}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    while chooser.chosen is None:
        now["t"] += cost[chooser.pick(torch.device("cpu"), groups)]
    assert chooser.chosen == chosen and chooser.medians == pytest.approx(cost)
    slow_dense = LayerCore._schedule_chooser(["hierarchical", "dense"])  # and the favourite still has to beat dense
    slow_dense.use_model({"hierarchical": 1.0, "dense": 2.0}, [])
    slow_dense.medians = {"hierarchical": 1.0, "dense": 1.02}
    slow_dense._decide_known()
    assert slow_dense.chosen == "dense"


@pytest.mark.parametrize("direct_s,hierarchical_s,seen,chosen", [
    # (3 warm-up steps of the favourite, then rounds in rotated order)
    # direct's first step is 1.5x dense's: dropped after round 1; hierarchical (the favourite) stays and loses
    (1.5, 1.1, ["hierarchical"] * 3 + ["hierarchical", "direct", "dense", "dense", "hierarchical", "dense",
                                       "hierarchical", "dense"], "dense"),
    # within the ratio: nothing dropped, every candidate runs its three trials
    (1.2, 1.1, ["hierarchical"] * 3 + ["hierarchical", "direct", "dense", "direct", "dense", "hierarchical", "dense",
                                       "hierarchical", "direct", "dense"], "dense"),
])
def test_step_timed_choice_drops_a_clearly_slower_candidate_after_one_round(monkeypatch, direct_s, hierarchical_s,
                                                                            seen, chosen) -> None:
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import SCREEN_RATIO, LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["hierarchical", "direct", "dense"])
    assert chooser.screen_ratio == SCREEN_RATIO == 1.25
    cost = {"hierarchical": hierarchical_s, "direct": direct_s, "dense": 1.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    picks = []
    while chooser.chosen is None:
        picks.append(chooser.pick(torch.device("cpu"), groups))
        now["t"] += cost[picks[-1]]
    assert picks == seen and chooser.chosen == chosen
    assert chooser.screened == ({"direct": direct_s} if direct_s > SCREEN_RATIO else {})
    assert chooser.medians == pytest.approx(cost)


def test_step_timed_choice_never_drops_the_favourite_or_the_preferred(monkeypatch) -> None:
    """One slow outlier step of dense (preferred) or of the model's favourite drops neither."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = tile_tuner.StepTimedChoice(["hierarchical", "direct", "dense"], prefer="dense", screen_ratio=1.25)
    cost = {"hierarchical": 1.0, "direct": 1.0, "dense": 1.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    for i in range(4):
        pick = chooser.pick(torch.device("cpu"), groups)
        now["t"] += cost[pick] * (3.0 if i in (1, 3) else 1.0)  # hierarchical's and dense's first timed steps
    chooser.pick(torch.device("cpu"), groups)
    assert chooser.screened == {} and chooser.candidates == ["hierarchical", "direct", "dense"]
    # a single remaining candidate is chosen at once; the others' first steps are shown as their timings
    two = tile_tuner.StepTimedChoice(["hierarchical", "direct"], screen_ratio=1.25)
    for c in ("hierarchical", "hierarchical", "direct"):
        assert two.pick(torch.device("cpu"), groups) == c
        now["t"] += 1.0 if c == "hierarchical" else 2.0
    assert two.pick(torch.device("cpu"), groups) == "hierarchical" and two.chosen == "hierarchical"
    assert two.screened == {"direct": 2.0} and two.medians == {"hierarchical": 1.0, "direct": 2.0}
    # dense goes too where the model prices it clearly higher (a slow link: its padded blocks cost more); not where
    # the model's saving is within `clear_saving` (1.05: 5 % below dense's price) or where it prices dense lower
    for dense_predicted, dropped in ((3.0, True), (1.05, False), (0.5, False)):
        slow_link = tile_tuner.StepTimedChoice(["hierarchical", "dense"], prefer="dense", screen_ratio=1.25,
                                               clear_saving=0.10)
        slow_link.use_model({"hierarchical": 1.0, "dense": dense_predicted}, [])
        first = slow_link.candidates[0]
        for c in (first, *slow_link.candidates):
            assert slow_link.pick(torch.device("cpu"), groups) == c
            now["t"] += 1.0 if c == "hierarchical" else 2.0
        slow_link.pick(torch.device("cpu"), groups)
        assert (slow_link.chosen == "hierarchical") == dropped and bool(slow_link.screened) == dropped


@pytest.mark.parametrize("direct_predicted,fastest,screened", [
    (3.0, "dense", {"direct": 1.15}),  # the model, too, prices direct above dense (the fastest): dropped
    (1.2, "dense", {}),  # the model prices direct below dense: kept
    (3.0, "hierarchical", {}),  # dense 1.15x the fastest: the safe choice needs SCREEN_RATIO, model or not
])
def test_step_timed_choice_drops_sooner_where_the_model_agrees(monkeypatch, direct_predicted, fastest,
                                                               screened) -> None:
    """Past AGREED_SCREEN_RATIO (not SCREEN_RATIO) a candidate goes after one round if the model also predicts it
    slower than the fastest; dense, the safe choice, still needs SCREEN_RATIO; the favourite always stays."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import AGREED_SCREEN_RATIO, SCHEDULE_WARMUP, SCREEN_RATIO, LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    assert 1.0 < AGREED_SCREEN_RATIO < 1.15 < SCREEN_RATIO
    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["hierarchical", "direct", "dense"])
    chooser.use_model({"hierarchical": 1.0, "direct": direct_predicted, "dense": 2.0}, [])
    order = list(chooser.candidates)
    assert order[0] == "hierarchical"  # the favourite
    cost = {c: 1.0 if c == fastest else 1.15 for c in ("hierarchical", "direct", "dense")}
    if fastest == "hierarchical":
        cost["direct"] = 1.05  # within AGREED_SCREEN_RATIO
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    for _ in range(SCHEDULE_WARMUP + 4):  # warm-up + round 1, then the screening
        now["t"] += cost[chooser.pick(torch.device("cpu"), groups)]
    assert chooser.screened == pytest.approx(screened)
    assert chooser.candidates == [c for c in order if c not in screened]


@pytest.mark.parametrize("hierarchical_s,chosen", [(0.6, "hierarchical"), (0.98, "dense"), (1.3, "dense")])
def test_step_timed_choice_with_a_known_time_runs_no_trial_of_it(monkeypatch, hierarchical_s, chosen) -> None:
    """After a layout change dense's earlier time stands (its traffic does not depend on the layout): only the
    kept schedule runs (warm-up + repeats), then one all-reduce compares it with that time, margin included."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import SCHEDULE_WARMUP, LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["hierarchical", "dense"], known={"dense": 1.0})
    assert chooser.candidates == ["hierarchical"] and not chooser.wants_model and chooser.chosen is None
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    picks = []
    while chooser.chosen is None:
        picks.append(chooser.pick(torch.device("cpu"), groups))
        now["t"] += hierarchical_s
    # SCHEDULE_WARMUP + 3 steps timed, the next forward runs the choice
    assert picks == ["hierarchical"] * (SCHEDULE_WARMUP + 3) + [chosen]
    assert chooser.chosen == chosen and chooser.medians == pytest.approx({"hierarchical": hierarchical_s, "dense": 1.0})
    # everything known: decided at once, no trial, no collective
    assert tile_tuner.StepTimedChoice(["dense"], known={"dense": 1.0}).chosen == "dense"


@pytest.mark.parametrize("hierarchical_s,priced,chosen", [
    (0.98, True, "hierarchical"),  # a close call keeps the schedule kept before
    (1.3, True, "hierarchical"),  # dense 23 % faster: under DISPUTED_DENSE_MARGIN where the model prices dense above
    (1.5, True, "dense"),  # 33 % faster
    (1.3, False, "dense"),  # without a model, DENSE_MARGIN
])
def test_re_timing_against_dense_keeps_the_schedule_kept(monkeypatch, hierarchical_s, priced, chosen) -> None:
    """A re-timing against dense's known time (`install_layout` after a clear win) prefers the schedule kept: dense
    replaces it only where it measures the margin faster."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    chooser = LayerCore._schedule_chooser(["hierarchical", "dense"], known={"dense": 1.0}, warmup=1,
                                          prefer="hierarchical")
    if priced:  # as `install_layout` sets it: the last decision's predictions
        chooser.predicted = {"hierarchical": 1.0, "dense": 2.0}
    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    while chooser.chosen is None:
        chooser.pick(torch.device("cpu"), groups)
        now["t"] += hierarchical_s
    assert chooser.chosen == chosen
    assert tile_tuner.StepTimedChoice(["hierarchical", "dense"], known={"hierarchical": 1.0, "dense": 2.0},
                                      prefer="dense").chosen == "hierarchical"


def test_step_timed_choice_follows_the_model() -> None:
    """The model's order: the best-predicted candidate takes the warm-up and the first trial; pruned ones never
    run, except the preferred (safe) one; with everything pruned but one, it is chosen at once."""
    from ds_cobalt.runtime.tile_tuner import StepTimedChoice

    chooser = StepTimedChoice(["hierarchical", "direct", "dense"], repeats=2, warmup=1)
    assert chooser.wants_model
    chooser.use_model({"hierarchical": 3.0, "direct": 2.0, "dense": 1.0}, ["hierarchical"])
    assert not chooser.wants_model
    assert chooser.trials == ["dense", "dense", "direct", "direct", "dense"] and chooser.pruned == ["hierarchical"]
    alone = StepTimedChoice(["hierarchical", "dense"])
    alone.use_model({"hierarchical": 1.0, "dense": 5.0}, ["dense"])
    assert alone.chosen == "hierarchical" and alone.candidates == ["hierarchical"]
    # the safe candidate is measured even where the model rules it out (it is then screened after one slow step)
    safe = StepTimedChoice(["hierarchical", "direct", "dense"], repeats=2, warmup=1, prefer="dense")
    safe.use_model({"hierarchical": 1.0, "direct": 5.0, "dense": 5.0}, ["direct", "dense"])
    assert safe.pruned == ["direct", "dense"] and safe.candidates == ["hierarchical", "dense"]
    assert safe.chosen is None and safe.trials == ["hierarchical", "hierarchical", "dense", "dense", "hierarchical"]


@pytest.mark.parametrize("predicted, pruned, material, expected", [
    ({"hierarchical": 0.8, "direct": 0.95, "dense": 1.0}, [], True, True),  # 20 % below dense: a layout pays
    ({"hierarchical": 0.8, "direct": 0.95, "dense": 1.0}, [], False, False),  # ... but not against the step
    ({"hierarchical": 0.95, "direct": 0.92, "dense": 1.0}, [], True, False),  # within CLEAR_SAVING of dense
    ({"hierarchical": 1.5, "direct": 2.0, "dense": 1.0}, [], True, False),  # dense is the favourite
    ({"hierarchical": 0.3, "direct": 2.0, "dense": 1.0}, ["hierarchical"], True, False),  # only a pruned one gains
    ({"hierarchical": 0.5, "direct": 0.6, "dense": 5.0}, ["dense"], False, True),  # dense ruled out
])
def test_expects_layout_gain_follows_the_cost_model_until_the_first_choice(predicted, pruned, material,
                                                                           expected) -> None:
    """`LayerCore.expects_layout_gain` (the plan before `auto`'s trials): the model rules dense out, or prices a
    layout-dependent schedule at least CLEAR_SAVING below dense and that saving is material to the step
    (`layout_gain_material`, from `ScheduleGate`), and the gate, where it judged them, priced owner moves
    (`owner_moves_priced`); never without a model or after the choice."""
    from ds_cobalt.runtime.layer import LayerCore
    from ds_cobalt.runtime.tile_tuner import StepTimedChoice

    core = LayerCore.__new__(LayerCore)
    core._kept_schedule, core.layout_gain_material, core.schedule_history = None, material, []
    core.owner_moves_judged = core.owner_moves_priced = False
    core._chooser = StepTimedChoice(["hierarchical", "direct", "dense"])
    assert not core.expects_layout_gain  # no model yet
    core._chooser.use_model(predicted, pruned)
    assert core.expects_layout_gain is expected
    core.owner_moves_judged = True  # the gate found the saving too small for owner moves: no plan before the trials
    assert not core.expects_layout_gain
    core.owner_moves_priced = True
    assert core.expects_layout_gain is expected
    core._kept_schedule = "hierarchical"  # the first choice is made: the usual re-plans take over
    assert not core.expects_layout_gain


def _core_in_first_warm_up(monkeypatch) -> tuple[Any, dict[str, float]]:
    """A bare `LayerCore` before its first `auto` choice among hierarchical, direct and dense (no model yet), and the
    clock its trials read (`now["t"]`, seconds)."""
    from ds_cobalt.runtime import tile_tuner
    from ds_cobalt.runtime.layer import LayerCore

    now = {"t": 0.0}
    monkeypatch.setattr(tile_tuner.time, "perf_counter", lambda: now["t"])
    core = LayerCore.__new__(LayerCore)
    core._kept_schedule, core._dense_seconds, core.forwards, core.schedule_history = None, None, 0, []
    core._chooser_from_forward, core.layout_gain_material = 0, True
    core.owner_moves_judged = core.owner_moves_priced = False  # as `LayerCore.__init__` sets them
    core._chooser = LayerCore._schedule_chooser(["hierarchical", "direct", "dense"])
    return core, now


def test_first_trials_due_after_the_warm_up_and_settle_dense_makes_the_choice(monkeypatch) -> None:
    """`LayerCore.first_trials_due`: the warm-up steps of the model's favourite are over and dense is among the
    candidates to time; `warmup_step_s` is the median warm-up window without the run's first step;
    `predicted_dense_gaps` gives the model's saving of the best and of the favourite; `settle_dense` makes dense the
    first choice without trials, recorded (with the share) in the history, and then no owner may move."""
    from ds_cobalt.runtime.layer import DENSE, SCHEDULE_WARMUP, LayerCore
    from ds_cobalt.runtime.topology import EPGroups

    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    core, now = _core_in_first_warm_up(monkeypatch)
    assert not core.first_trials_due and core.warmup_step_s is None  # no model, no window
    core._chooser.use_model({"hierarchical": 0.5, "direct": 0.7, "dense": 1.0}, [])
    assert core.dense_contested
    windows = [2.0, 0.3, 0.2][:SCHEDULE_WARMUP]
    for n, window in enumerate(windows):
        assert not core.first_trials_due
        assert core._chooser.pick(torch.device("cpu"), groups) == "hierarchical"
        core.forwards += 1
        now["t"] += window
        core._chooser.step_end(torch.device("cpu"))
        assert core.warmup_step_s == pytest.approx(2.0 if n == 0 else float(np.median(windows[1: n + 1])))
    assert core.first_trials_due
    assert core.predicted_dense_gaps() == pytest.approx((0.5, 0.5))
    core.settle_dense(0.04)
    assert core.schedule == DENSE and core.first_schedule_chosen and not core.first_trials_due
    assert core.schedule_history == [{"forward": SCHEDULE_WARMUP, "schedule": DENSE, "timings_s": {},
                                      "model": {"predicted_comm_s": {"hierarchical": 0.5, "direct": 0.7, "dense": 1.0},
                                                "pruned": []},
                                      "untimed_saving_share": 0.04}]
    assert not core.owners_may_move and not core.expects_layout_gain
    # dense pruned by the model: nothing to gate
    ruled_out = LayerCore.__new__(LayerCore)
    ruled_out._kept_schedule, ruled_out._chooser_from_forward = None, 0
    ruled_out._chooser = LayerCore._schedule_chooser(["hierarchical", "direct", "dense"], warmup=1)
    ruled_out._chooser.use_model({"hierarchical": 0.1, "direct": 0.2, "dense": 1.0}, ["dense"])
    ruled_out._chooser.pick(torch.device("cpu"), groups)
    ruled_out._chooser.step_end(torch.device("cpu"))
    assert ruled_out._chooser.trials_due and not ruled_out.dense_contested and not ruled_out.first_trials_due


def test_warm_up_on_dense_runs_the_rest_of_the_warm_up_and_leads_the_trials(monkeypatch) -> None:
    """`LayerCore.warm_up_on_dense` after the first warm-up step (`ScheduleGate`, an immaterial saving after step 1):
    dense runs the remaining warm-up steps, whose windows alone (not the favourite's first one) make
    `warmup_step_s`; the model's gap to the warm-up's candidate is then 0, and the trials start with dense and
    rotate as before. Nothing changes once no warm-up step is left; a non-candidate is refused."""
    from ds_cobalt.runtime.layer import DENSE, SCHEDULE_WARMUP
    from ds_cobalt.runtime.topology import EPGroups

    assert SCHEDULE_WARMUP >= 2
    groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
    core, now = _core_in_first_warm_up(monkeypatch)
    core._chooser.use_model({"hierarchical": 0.5, "direct": 0.45, "dense": 0.5}, [])
    cpu = torch.device("cpu")

    def step(window: float) -> str:
        ran = core._chooser.pick(cpu, groups)
        core.forwards += 1
        now["t"] += window
        core._chooser.step_end(cpu)
        return ran

    assert step(2.0) == "direct"  # the model's favourite runs the run's first step
    with pytest.raises(ValueError, match="'none' is not among"):
        core._chooser.lead_with("none")
    core.warm_up_on_dense()
    assert core.warmup_step_s is None  # the favourite's window is not dense's
    windows = [0.3, 0.2, 0.25, 0.28][: SCHEDULE_WARMUP - 1]
    assert [step(w) for w in windows] == [DENSE] * (SCHEDULE_WARMUP - 1)
    assert core.first_trials_due and core.warmup_step_s == pytest.approx(float(np.median(windows)))
    assert core.predicted_dense_gaps() == pytest.approx((0.05, 0.0))
    assert core._chooser.candidates == [DENSE, "direct", "hierarchical"]
    assert [step(0.2) for _ in range(3)] == [DENSE, "direct", "hierarchical"]  # round 1, dense first
    assert core._chooser.trials[SCHEDULE_WARMUP + 3: SCHEDULE_WARMUP + 6] == ["direct", "hierarchical", DENSE]
    trials = list(core._chooser.trials)
    assert not core._chooser.lead_with("direct") and core._chooser.trials == trials  # no warm-up step left
    # several forwards per optimizer step (gradient accumulation) can end the warm-up within step 1: nothing to lead
    core, now = _core_in_first_warm_up(monkeypatch)
    core._chooser.use_model({"hierarchical": 0.5, "direct": 0.45, "dense": 0.5}, [])
    for _ in range(SCHEDULE_WARMUP):
        core._chooser.pick(cpu, groups)
        core.forwards += 1
    core.warm_up_on_dense()
    assert core._chooser.candidates[0] == "direct" and core._chooser_from_forward == 0


def _routing(rng, E: int, K: int, W: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Skewed routes (a few hot experts), `tokens` per rank."""
    weights = rng.dirichlet(np.full(E, 0.5))
    topk = np.stack([rng.choice(E, size=K, replace=False, p=weights) for _ in range(tokens * W)])
    return topk, np.repeat(np.arange(W), tokens)


def test_schedule_model_prices_calls_on_fast_links_and_bytes_on_slow_ones() -> None:
    """Exact row counts from the routes under the layout, priced like the simulator: on a fast link the
    fewest collectives win (dense and direct: DeepSpeed's calls), on a slow one the fewest cross-node bytes
    (hierarchical), and a fine-grained top-6 layer's padded exchange is ruled out by the model alone."""
    from ds_cobalt.runtime.link_probe import LinkCosts
    from ds_cobalt.runtime.schedule_model import hardware_of, model_pruned, predict_comm_seconds

    rng = np.random.default_rng(0)
    W, G, row_bytes, fixed = 4, 2, 256, 3e-3
    candidates = ["hierarchical", "direct", "dense"]
    fast = LinkCosts(fixed_s=fixed, inter_node_bytes_per_s=1e10, intra_node_bytes_per_s=1e10, probe_bytes=1)
    # 100 Mbit/s shared by the node's 2 ranks
    slow = LinkCosts(fixed_s=fixed, inter_node_bytes_per_s=6.25e6, intra_node_bytes_per_s=1e9, probe_bytes=1)
    for E, K, slow_order, slow_pruned in ((8, 2, ["hierarchical", "direct", "dense"], []),
                                          (32, 6, ["hierarchical", "direct", "dense"], ["dense"])):
        topk, src = _routing(rng, E, K, W, 256)
        capacity = max(int(np.bincount(topk[src == r].ravel(), minlength=E).max()) for r in range(W))  # dropless
        slots = contiguous_layout(E, 2, G).layer(0)
        args = (topk, src, 1.0, slots, G, E, capacity, row_bytes)
        on_fast = predict_comm_seconds(candidates, *args, hardware_of(fast, G), dropless=True)
        on_slow = predict_comm_seconds(candidates, *args, hardware_of(slow, G), dropless=True)
        assert model_pruned(on_fast, fixed) == []
        # the fixed cost dominates: dense 4 all-to-alls + the capacity all-reduce, direct 1 + 4, hierarchical 1 + 8
        assert on_fast["dense"] == pytest.approx(5 * fixed, rel=0.05)
        assert on_fast["direct"] == pytest.approx(5 * fixed, rel=0.05)
        assert on_fast["hierarchical"] == pytest.approx(9 * fixed, rel=0.05)
        assert sorted(on_slow, key=on_slow.get) == slow_order
        assert model_pruned(on_slow, fixed) == slow_pruned
        # twice the tokens in the sample's scale: the bytes double, the calls stay
        doubled = predict_comm_seconds(["hierarchical"], topk, src, 2.0, *args[3:], hardware_of(slow, G),
                                       dropless=True)
        bytes_part = on_slow["hierarchical"] - 9 * fixed
        assert doubled["hierarchical"] - 9 * fixed == pytest.approx(2 * bytes_part, rel=1e-6)
    # replicas: rank 2 (node 1) holds a traffic copy of rank 0's expert; its weights cross the slow link in forward
    # and its gradients in backward, two more all-to-alls for hierarchical and direct, none for dense
    E, expert_bytes = 8, 10**5
    topk, src = _routing(rng, E, 2, W, 256)
    slots = np.concatenate([contiguous_layout(E, 2, G).layer(0), np.full((W, 1), -1)], axis=1)
    copied = slots.copy()
    copied[2, -1] = 0
    for candidate in candidates:
        def cost(layout, size, candidate=candidate):
            return predict_comm_seconds([candidate], topk, src, 1.0, layout, G, E, 64, row_bytes,
                                        hardware_of(slow, G), dropless=True, expert_bytes=size)[candidate]
        extra = 0.0 if candidate == "dense" else 2 * (fixed + expert_bytes / 6.25e6)
        assert cost(copied, expert_bytes) - cost(copied, 0) == pytest.approx(extra, rel=1e-6, abs=1e-12), candidate
        assert cost(slots, expert_bytes) == cost(slots, 0)  # no spare slot filled: nothing fetched


def test_schedule_model_prices_autoep_dense_as_its_dropless_exchange() -> None:
    """AutoEP layers' dense schedule is AutoEP's exchange (`native_dense`): a count all-to-all and one row per route
    to its expert's owner under the layer's layout, never more than the padded blocks and never fewer rows than
    direct (which sends a token once per rank)."""
    from ds_cobalt.runtime.link_probe import LinkCosts
    from ds_cobalt.runtime.schedule_model import hardware_of, predict_comm_seconds

    rng = np.random.default_rng(1)
    W, G, E, K, row_bytes, fixed = 4, 2, 32, 6, 256, 3e-3
    fast = LinkCosts(fixed_s=fixed, inter_node_bytes_per_s=1e10, intra_node_bytes_per_s=1e10, probe_bytes=1)
    slow = LinkCosts(fixed_s=fixed, inter_node_bytes_per_s=6.25e6, intra_node_bytes_per_s=1e9, probe_bytes=1)
    topk, src = _routing(rng, E, K, W, 256)
    capacity = max(int(np.bincount(topk[src == r].ravel(), minlength=E).max()) for r in range(W))
    contiguous = contiguous_layout(E, 2, G).layer(0)

    def priced(candidates, link, layout=contiguous, routes=topk, native=True):
        return predict_comm_seconds(candidates, routes, src, 1.0, layout, G, E, capacity, row_bytes,
                                    hardware_of(link, G), dropless=True, native_dense=native)

    assert priced(["dense"], fast)["dense"] == pytest.approx(5 * fixed, rel=0.05)  # counts + 4 all-to-alls
    on_slow = priced(["direct", "dense"], slow)
    assert on_slow["direct"] <= on_slow["dense"] < priced(["dense"], slow, native=False)["dense"]
    # every source rank's routes go to experts it owns itself under this layout: nothing crosses, only calls
    own_W = rng.permutation(E).reshape(W, E // W)
    local = own_W[src][np.arange(src.size)[:, None], rng.integers(0, E // W, size=(src.size, K))]
    assert priced(["dense"], slow, own_W, local)["dense"] == pytest.approx(5 * fixed, rel=1e-6)
    assert priced(["dense"], slow, contiguous, local)["dense"] > 6 * fixed


def test_remote_nodes_per_token_matches_the_planner() -> None:
    """The runtime's count of remote nodes per token (what the replanner confirms plans with) equals the planner's
    on 2 nodes (where the greedy cover is exact), with replicas and dropped routes."""
    from ds_cobalt.planner.decisions import remote_nodes_of
    from ds_cobalt.runtime.placement import remote_nodes_per_token

    rng = np.random.default_rng(3)
    slots = np.array([[0, 5, 7], [1, 4, 2], [2, 6, 0], [3, 7, 5]])  # 8 experts, one spare slot per rank
    topk = rng.integers(-1, 8, size=(400, 3))
    source = rng.integers(0, 4, size=400)
    want = remote_nodes_of(topk, source, slots, 2)
    placement = build_placement(slots, 2, 8)
    got = np.zeros(400, dtype=np.int64)
    for src in range(4):
        got[source == src] = remote_nodes_per_token(torch.from_numpy(topk[source == src]), placement, src).numpy()
    np.testing.assert_array_equal(got, want)
    assert want.max() == 1 and want.min() == 0


def test_sync_free_counts_and_copies_match_torch_and_are_not_counted():
    from ds_cobalt.runtime.call_counts import count_host_syncs
    from ds_cobalt.runtime.sync_free import count_keys, device_ints

    key = torch.tensor([3, 0, 2, 2, 5, 0, 2])  # 5 = the ignored key
    with count_host_syncs() as syncs:
        counts = count_keys(key, 5)
        nested = device_ints([[1, 2], [3, 4]], "cpu")
        from_array = device_ints(np.array([7, 8]), torch.device("cpu"))
    assert not syncs
    assert counts.tolist() == torch.bincount(key, minlength=6)[:5].tolist() == [2, 0, 3, 1, 0]
    assert nested.dtype == from_array.dtype == torch.int64
    assert nested.tolist() == [[1, 2], [3, 4]] and from_array.tolist() == [7, 8]
    # the torch idioms they replace are counted (on CUDA both make the host wait)
    with count_host_syncs() as syncs:
        torch.bincount(key)
        torch.tensor([1, 2], device="cpu")
        torch.as_tensor(np.array([1]), device="cpu")
        torch.as_tensor(key, device="cpu")  # already a tensor: no host data to copy
    assert sum(syncs.values()) == 3


@pytest.mark.parametrize("backend,cuda,expected", [
    ("gloo", True, "cpu"), ("cpu:gloo,cuda:nccl", True, "cpu"), ("mpi", True, "cpu"),
    ("nccl", True, "cuda:0"), ("nccl", False, "cpu"),
])
def test_collective_device_follows_the_backend(monkeypatch, backend, cuda, expected) -> None:
    """NCCL has no host transport (a CPU tensor in its all_reduce fails: "No backend type associated with device
    type cpu", seen on an H200), so host values go through the current CUDA device there."""
    import torch.distributed as dist

    from ds_cobalt.runtime import comm

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert comm.collective_device() == torch.device(expected)


def _all_reduce_host_body(rank: int, world: int) -> list:
    import torch.distributed as dist

    from ds_cobalt.runtime.comm import all_reduce_host

    summed = all_reduce_host(torch.tensor([1.0, rank], dtype=torch.float64))
    smallest = all_reduce_host(torch.tensor([rank + 3]), dist.ReduceOp.MIN)
    return [summed.device.type, summed.tolist(), smallest.tolist()]


def test_all_reduce_host_returns_host_values(run_ranks) -> None:
    results = run_ranks(_all_reduce_host_body, 2, ranks_per_node=1, timeout=120)
    assert results == [["cpu", [2.0, 1.0], [3]]] * 2


def test_replica_modes_and_no_replicas_carried_over_layouts() -> None:
    """`LayerCore.replica_modes`: with `planner.stage2: "auto"` the hierarchical schedule times stage 2 every step,
    the re-plan's replicas and none, the direct schedule the last two, dense nothing; a pinned stage 2 times nothing.
    Once "none" won clearly for a schedule, a later layout keeps it without trials (`_replica_mode`); after a narrow
    win the modes are timed again. Near-ties keep "none", or the replicas where the layer is `traffic_bound`, and
    there a clear win of the replicas is carried over too."""
    import types

    from ds_cobalt.runtime.layer import DENSE_MARGIN, LayerCore
    from ds_cobalt.runtime.tile_tuner import StepTimedChoice
    from ds_cobalt.runtime.topology import EPGroups

    def core(stage2: str, spares: bool = True) -> LayerCore:
        c = LayerCore.__new__(LayerCore)
        c.settings = types.SimpleNamespace(planner=types.SimpleNamespace(stage2=stage2),
                                           overlap=types.SimpleNamespace(enabled=False))
        c._placement, c._bare = object(), (object(), object())  # a layout with filled spare slots
        c._spares = object() if spares else None
        c._chooser = StepTimedChoice(["direct"])  # the schedule is decided
        c._replica_chooser = c._replica_schedule = None
        c.replica_history, c.forwards, c.schedule_history, c.owner_moves_priced = [], 0, [], False
        c._groups = EPGroups(Topology(1, 1, 0), (0,), None, None, None)
        return c

    auto = core("auto")
    assert auto.replica_modes("hierarchical") == ["step", "interval", "none"]
    assert auto.replica_modes("direct") == ["interval", "none"] and auto.replica_modes("dense") == []
    assert core("interval", spares=False).replica_modes("hierarchical") == ["interval"]
    assert core("step").replica_modes("hierarchical") == ["step"] and core("step").replica_modes("direct") == []
    cpu = torch.device("cpu")
    assert auto._replica_mode("direct", cpu) == "interval" and auto.stage2 is None  # timed: the first mode warms up
    assert (auto._replica_chooser.prefer, auto._replica_chooser.margin) == ("none", DENSE_MARGIN)  # none unless beaten
    # where the layer's traffic is material (dense ruled out in the last decision, or a material saving priced by
    # the gate), the replicas stay unless "none" is DENSE_MARGIN faster
    for bound in ({"schedule_history": [{"schedule": "direct", "timings_s": {}, "model": {"pruned": ["dense"]}}]},
                  {"owner_moves_priced": True}):
        traffic = core("auto")
        traffic.__dict__.update(bound)
        assert traffic.traffic_bound and traffic._replica_mode("direct", cpu) == "interval"
        assert traffic._replica_chooser.prefer == "interval"
    assert not auto.traffic_bound
    again = core("auto")
    clear = {"none": 0.2, "interval": 0.2 / (1.0 - DENSE_MARGIN) + 1e-6}
    again.replica_history = [{"forward": 20, "schedule": "direct", "stage2": "none", "timings_s": clear}]
    assert again._replica_mode("direct", cpu) == "none" and again.stage2 == "none"  # carried over, no trial
    assert again._replica_chooser.candidates == ["none"]
    # a narrow win of "none", or one kept by preference, is timed again on the next layout
    for timings in ({"none": 0.2, "interval": 0.205}, {"none": 0.25, "interval": 0.239}):
        narrow = core("auto")
        narrow.replica_history = [{"forward": 20, "schedule": "direct", "stage2": "none", "timings_s": timings}]
        assert narrow._replica_mode("direct", cpu) == "interval" and narrow.stage2 is None
        assert narrow._replica_chooser.candidates == ["interval", "none"]
    # where the layer is `traffic_bound`, a clear win of the replicas over "none" is carried over as well (only
    # there, and only a clear one: what replicas save depends on the layout)
    won = {"none": 0.25, "interval": 0.25 * (1.0 - DENSE_MARGIN) - 1e-6}
    close = {"none": 0.25, "interval": 0.245}
    for owners_priced, timings, carried in ((True, won, True), (True, close, False), (False, won, False)):
        layer = core("auto")
        layer.owner_moves_priced = owners_priced
        layer.replica_history = [{"forward": 20, "schedule": "direct", "stage2": "interval", "timings_s": timings}]
        assert layer._replica_mode("direct", cpu) == "interval"
        assert layer._replica_chooser.candidates == (["interval"] if carried else ["interval", "none"])
        assert (layer._replica_chooser.chosen == "interval") == carried  # carried over: decided, no trial


def test_dense_ruled_out_for_a_layout_stays_ruled_out_at_the_hold_ratio() -> None:
    """`LayerCore._model_pruning`: dense, which the model ruled out (2x the best) for the layout the kept schedule
    was chosen on, stays ruled out on the next layout while predicted `RULED_OUT_HOLD_RATIO` times the best (its
    traffic does not depend on the layout); without that, or below the ratio, only the 2x rule applies. The flag
    follows the last modelled choice (`_note_dense_ruled_out`) and clears on a layer that kept dense."""
    from ds_cobalt.runtime.layer import DENSE, RULED_OUT_HOLD_RATIO, LayerCore
    from ds_cobalt.runtime.tile_tuner import StepTimedChoice

    core = LayerCore.__new__(LayerCore)
    core._dense_ruled_out = False
    first = StepTimedChoice(["hierarchical", "direct", DENSE])
    first.use_model({"hierarchical": 0.08, "direct": 0.14, DENSE: 0.22}, [DENSE])
    core._note_dense_ruled_out(first, "hierarchical")
    assert core._dense_ruled_out
    fixed = 1e-3
    later = {"hierarchical": 0.11, DENSE: 0.22 - 1e-6}  # 1.96x: under the 2x rule
    assert LayerCore._model_pruning(core, later, fixed) == [DENSE]
    below = {"hierarchical": 0.11, DENSE: 0.11 * RULED_OUT_HOLD_RATIO - 1e-6}
    assert LayerCore._model_pruning(core, below, fixed) == []
    assert LayerCore._model_pruning(core, later, 0.02) == []  # within 10 collectives' fixed cost
    unmodelled = StepTimedChoice(["hierarchical", DENSE])  # a layout that came before the re-timing's model ran
    core._note_dense_ruled_out(unmodelled, "hierarchical")
    assert core._dense_ruled_out
    timed = StepTimedChoice(["hierarchical", DENSE])
    timed.use_model(later, [])
    core._note_dense_ruled_out(timed, "hierarchical")
    assert not core._dense_ruled_out and LayerCore._model_pruning(core, later, fixed) == []
    core._dense_ruled_out = True
    core._note_dense_ruled_out(first, DENSE)  # a layer on dense
    assert not core._dense_ruled_out
