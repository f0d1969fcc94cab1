"""Cluster simulator (sim/cluster.py) and hardware presets (sim/hardware.py): numpy only, fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_cobalt.planner.layout import Layout, contiguous_layout
from ds_cobalt.planner.trace import Trace
from ds_cobalt.sim.cluster import (
    VARIANTS,
    cobalt_rows,
    deepspeed_rows,
    keep_faster_without_spares,
    layer_times,
    predict_step_times,
    predict_synthetic,
    replica_fetch,
    step_of_tokens,
)
from ds_cobalt.sim.hardware import (
    HARDWARE_PRESETS,
    MODEL_SHAPES,
    Hardware,
    ModelShape,
    get_hardware,
    hardware_from_dict,
    load_hardware_json,
    parse_rate,
    save_hardware_json,
)
from ds_cobalt.sim.synth import synth_trace

REPO = Path(__file__).resolve().parents[2]
SHAPE = ModelShape(num_experts=4, top_k=2, hidden=8, ffn=16, ffn_matrices=2, dtype_bytes=4)


def test_sim_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import ds_cobalt.sim.cluster, ds_cobalt.sim.hardware, ds_cobalt.sim.report, ds_cobalt.sim.report_compare\n"
            "import ds_cobalt.commands.calibrate, ds_cobalt.commands.report, ds_cobalt.cli\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_dedup_counts_one_row_per_remote_node():
    # 2 nodes x 1 GPU, experts {0,1} on rank 0 and {2,3} on rank 1; the token on rank 0 picks 2 and 3.
    topk = np.array([[2, 3], [0, 1]])
    src = np.array([0, 1])
    slots = contiguous_layout(4, 2, 1).layer(0)
    co = cobalt_rows(topk, src, slots, 1)
    assert co.inter_out_W.tolist() == [1, 1] and co.routes_out_W.tolist() == [2, 2]
    assert co.intra_out_W.sum() == 0 and co.compute_W.tolist() == [2, 2]
    ds = deepspeed_rows(topk, src, 4, 2, 1, padded=False)
    assert ds.inter_out_W.tolist() == [2, 2] and ds.compute_W.tolist() == [2, 2]


def test_padded_capacity_matches_deepspeed_formula():
    trace = synth_trace(num_experts=8, top_k=2, num_tokens=4096, seed=1)
    src = trace.source_ranks(4)
    ds = deepspeed_rows(trace.experts_LTK[0], src, 8, 2, 2, capacity_factor=1.25, min_capacity=4)
    C = int(np.ceil(1024 / 8 * 1.25 * 2))  # DeepSpeed _capacity(gates, capacity_factor * k, min_capacity)
    assert ds.compute_W.tolist() == [8 * C] * 4
    assert ds.inter_out_W.tolist() == [2 * 2 * C] * 4 and ds.intra_out_W.tolist() == [2 * C] * 4
    nodrop = deepspeed_rows(trace.experts_LTK[0], src, 8, 2, 2, capacity_factor=None)
    assert nodrop.compute_W[0] >= ds.compute_W[0] * 0  # well defined
    assert nodrop.compute_W[0] % 8 == 0


@pytest.mark.parametrize("E,N,G,K", [(4, 1, 4, 2), (8, 2, 2, 1), (8, 8, 1, 2), (16, 2, 2, 4)])
def test_degenerate_shapes(E, N, G, K):
    trace = synth_trace(num_experts=E, top_k=K, num_tokens=512, seed=0)
    hw = get_hardware("H100")
    pred = predict_step_times(trace, contiguous_layout(E, N, G), hw, ModelShape(num_experts=E, top_k=K, hidden=64,
                                                                                  ffn=128))
    assert set(pred["step_s"]) == set(VARIANTS)
    assert all(v > 0 for v in pred["step_s"].values())
    # overlap never costs more than its own schedule run serially (it keeps rows and routes apart and counts per
    # chunk, so where fixed costs dominate it can lose to the phased schedule's fewer collectives)
    overlap_serial = pred["comm_s"]["cobalt-overlap"] + pred["compute_s"]["cobalt-overlap"]
    assert pred["step_s"]["cobalt-overlap"] <= overlap_serial + 1e-12
    if N == 1:  # nothing crosses nodes
        rows = cobalt_rows(trace.experts_LTK[0], trace.source_ranks(N * G), contiguous_layout(E, N, G).layer(0), G)
        assert rows.inter_out_W.sum() == 0


def test_empty_experts_and_dropped_routes():
    topk = np.array([[0, -1], [-1, -1], [3, 1]])
    trace = Trace(topk[None], 4)
    pred = predict_step_times(trace, contiguous_layout(4, 2, 1), get_hardware("B200"), SHAPE)
    assert np.isfinite(pred["step_s"]["cobalt"])


def test_replicas_balance_compute():
    # All tokens pick expert 0; a replica of it on the node's other GPU halves the busiest GPU's rows.
    T = 400
    topk = np.stack([np.zeros(T, int), np.full(T, 1)], axis=1)
    trace = Trace(topk[None], 4)
    base = contiguous_layout(4, 1, 2)
    rep = Layout(4, 1, 2, np.array([[[0, 1, -1], [2, 3, 0]]]))
    r0 = cobalt_rows(topk, trace.source_ranks(2), base.layer(0), 2)
    r1 = cobalt_rows(topk, trace.source_ranks(2), rep.layer(0), 2)
    assert r1.compute_W.max() < r0.compute_W.max()


def test_replica_weights_are_priced_over_the_link_they_cross():
    """`replica_fetch`: the owner sends each spare slot's expert weights, inside the node or, for a traffic copy,
    across nodes; `layer_times` prices them (forward + backward) on that link, and not for dense."""
    E, expert_bytes = 4, 1000.0
    same_node = np.array([[0, 1], [1, 0], [2, -1], [3, -1]])  # ranks 0 and 1 (node 0) hold copies of each other
    other_node = np.array([[0, -1], [1, -1], [2, 0], [3, -1]])  # rank 2 (node 1) holds one of expert 0
    intra = replica_fetch(same_node, E, 2, expert_bytes)
    assert intra.intra_out_W.tolist() == [1000, 1000, 0, 0] and intra.intra_in_W.tolist() == [1000, 1000, 0, 0]
    assert not intra.inter_in_W.any()
    cross = replica_fetch(other_node, E, 2, expert_bytes)
    assert cross.inter_out_W.tolist() == [1000, 0, 0, 0] and cross.inter_in_W.tolist() == [0, 0, 1000, 0]
    assert not cross.intra_in_W.any() and replica_fetch(contiguous_layout(E, 2, 2).layer(0), E, 2, 1.0).empty
    hw = Hardware(name="t", gpus_per_node=2, inter_node_bw_gpu=1e3, inter_node_bw_node=2e3, intra_node_bw=1e6,
                  latency_s=0.0, collective_overhead_s=0.0, gemm_flops=1e12)
    shape = ModelShape(num_experts=E, top_k=1, hidden=1, ffn=1)
    topk = np.zeros((4, 1), dtype=np.int64)
    rows = cobalt_rows(topk, np.arange(4), contiguous_layout(E, 2, 2).layer(0), 2)

    def comm(variant, replicas):
        return layer_times(rows, variant, hw, shape, 2, replicas)["comm_s"]

    base = comm("cobalt", None)
    assert comm("cobalt", intra) - base == pytest.approx(2 * 1000 / 1e6)
    assert comm("cobalt", cross) - base == pytest.approx(2 * 1000 / 1e3)  # the busiest GPU's share of the link
    assert comm("cobalt-direct", cross) - comm("cobalt-direct", None) == pytest.approx(2.0)
    assert comm("cobalt-dense", cross) == comm("cobalt-dense", None)


def test_step_of_tokens_rank_major_and_step_major():
    W, per = 4, 3
    step_major = np.tile(np.repeat(np.arange(W), per), 2)
    rank_major = np.repeat(np.arange(W), 2 * per)
    assert step_of_tokens(step_major, W, W * per).tolist() == [0] * 12 + [1] * 12
    assert step_of_tokens(rank_major, W, W * per).tolist() == ([0] * 3 + [1] * 3) * 4


def test_presets_and_json_roundtrip(tmp_path):
    assert {"B200", "H100", "H200", "emulated-cpu"} <= set(HARDWARE_PRESETS)
    assert {"mixtral", "qwen", "deepseek"} <= set(MODEL_SHAPES)
    for hw in HARDWARE_PRESETS.values():
        assert hw.source
    save_hardware_json(HARDWARE_PRESETS["B200"], tmp_path / "b.json")
    assert load_hardware_json(tmp_path / "b.json") == HARDWARE_PRESETS["B200"]
    with pytest.raises(ValueError, match="intra_node_bw"):
        hardware_from_dict({**HARDWARE_PRESETS["B200"].to_json_dict(), "intra_node_bw": -1})
    with pytest.raises(ValueError, match="unknown key"):
        hardware_from_dict({**HARDWARE_PRESETS["B200"].to_json_dict(), "nvlink": 1})
    with pytest.raises(ValueError, match="unknown hardware preset"):
        get_hardware("A100")
    assert parse_rate("100mbit") == 12.5e6 and parse_rate("1gbit") == 125e6
    with pytest.raises(ValueError, match="tc rate"):
        parse_rate("fast")
    emu = HARDWARE_PRESETS["emulated-cpu"]
    assert emu.with_inter_node_rate("100mbit").inter_node_bw_node == emu.link_rates["100mbit"]


def test_less_bandwidth_more_time_and_cobalt_wins_when_comm_bound():
    trace = synth_trace(num_experts=16, top_k=4, num_tokens=2048, clustering=0.8, seed=3)
    layout = contiguous_layout(16, 4, 2)
    hw = get_hardware("emulated-cpu")
    shape = ModelShape(num_experts=16, top_k=4, hidden=4096, ffn=512, ffn_matrices=2, dtype_bytes=4)
    slow = predict_step_times(trace, layout, hw.with_inter_node_rate("100mbit"), shape)
    fast = predict_step_times(trace, layout, hw.with_inter_node_rate("10gbit"), shape)
    for v in VARIANTS:
        assert slow["step_s"][v] >= fast["step_s"][v]
    assert slow["speedup_vs_deepspeed"]["cobalt"] > 1.0


def test_predict_synthetic_small():
    shape = ModelShape(name="tiny", num_experts=16, top_k=2, hidden=512, ffn=1024, moe_layers=2, tokens_per_gpu=512)
    hw = Hardware(name="t", gpus_per_node=2, inter_node_bw_gpu=1e9, inter_node_bw_node=2e9, intra_node_bw=1e10,
                  latency_s=1e-6, gemm_flops=1e12, overlap=True)
    pred = predict_synthetic(shape, hw, 8, sample_tokens_per_gpu=128)
    assert pred["ep"] == 8 and pred["nodes"] == 4
    assert pred["speedup_vs_deepspeed"]["cobalt"] > 0
    assert json.loads(json.dumps(pred))


def test_spare_slots_are_left_unused_where_their_weights_cost_more_than_they_save():
    """`predict_synthetic` keeps, for the schedules whose spare slots `planner.stage2: "auto"` may leave unused, the
    faster of the layout with its replicas and without them: a replica that halves the busiest GPU's rows stays
    while its weights are cheap, and goes (the figures then are the bare layout's) once they cost more."""
    T = 400
    topk = np.stack([np.zeros(T, int), np.full(T, 1)], axis=1)  # every token picks experts 0 and 1 (rank 0)
    trace = Trace(topk[None], 4)
    rep = Layout(4, 1, 2, np.array([[[0, 1, -1], [2, 3, 0]]]))
    bare = Layout(4, 1, 2, np.array([[[0, 1, -1], [2, 3, -1]]]))
    # compute-bound small experts (the replica halves the busiest GPU's work), then large experts on fast GPUs
    for ffn, gemm_flops, replicas_pay in ((16, 1e6, True), (1 << 16, 1e18, False)):
        shape = ModelShape(num_experts=4, top_k=2, hidden=64, ffn=ffn, ffn_matrices=2, dtype_bytes=4)
        hw = Hardware(name="t", gpus_per_node=2, inter_node_bw_gpu=1e9, inter_node_bw_node=2e9, intra_node_bw=1e9,
                      latency_s=0.0, collective_overhead_s=0.0, gemm_flops=gemm_flops)
        pred = predict_step_times(trace, rep, hw, shape)
        with_replicas = dict(pred["step_s"])
        used = keep_faster_without_spares(pred, trace, rep, hw, shape, 1.25, 1.0)
        without = predict_step_times(trace, bare, hw, shape)["step_s"]
        assert used == {"cobalt": replicas_pay, "cobalt-direct": replicas_pay}
        for v in ("cobalt", "cobalt-direct"):
            assert (with_replicas[v] < without[v]) == replicas_pay
            assert pred["step_s"][v] == pytest.approx(min(with_replicas[v], without[v]))
            assert pred["speedup_vs_deepspeed"][v] == pytest.approx(pred["step_s"]["deepspeed"] / pred["step_s"][v])
        assert pred["step_s"]["cobalt-overlap"] == with_replicas["cobalt-overlap"]  # keeps the layout's replicas
