"""Bad input to the `ds-cobalt` verbs: exit code 2 with an error that names what is wrong, and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ds_cobalt.cli import main
from ds_cobalt.planner.layout import contiguous_layout, save_layout
from ds_cobalt.planner.policies import plan_layout
from ds_cobalt.planner.trace import save_trace
from ds_cobalt.sim.synth import synth_trace

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {"t16": tmp_path / "t16.npz", "t32": tmp_path / "t32.npz", "l16": tmp_path / "l16.json"}
    save_trace(synth_trace(num_experts=16, top_k=2, num_tokens=400, num_layers=2, seed=1), out["t16"])
    save_trace(synth_trace(num_experts=32, top_k=2, num_tokens=400, seed=2), out["t32"])
    save_layout(contiguous_layout(16, 2, 2, num_layers=2), out["l16"])
    return out


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_plan_checks_the_current_layout_and_outputs(files, tmp_path, capsys):
    t16, t32, l16 = (str(files[k]) for k in ("t16", "t32", "l16"))
    out = tmp_path / "q.json"
    # another number of experts, another topology: the compiled kernels would read out of bounds
    assert "num_experts=16 on 2 x 2 GPUs, the plan for num_experts=32" in _error(
        capsys, ["plan", "--trace", t32, "--nodes", "2", "--gpus-per-node", "2", "--current", l16, "--out", str(out)])
    assert "the plan for num_experts=16 on 4 x 1" in _error(
        capsys, ["plan", "--trace", t16, "--nodes", "4", "--gpus-per-node", "1", "--current", l16, "--out", str(out)])
    # outputs checked before planning: nothing is written when one of them cannot be
    assert "does not exist" in _error(capsys, ["plan", "--trace", t16, "--nodes", "2", "--gpus-per-node", "2",
                                               "--plot", str(tmp_path / "nodir" / "p.png"), "--out", str(out)])
    assert "is a directory" in _error(capsys, ["plan", "--trace", t16, "--nodes", "2", "--gpus-per-node", "2",
                                               "--out", str(tmp_path)])
    assert not out.exists()
    with pytest.raises(ValueError, match="nodes must be an int"):
        plan_layout(synth_trace(num_experts=16, top_k=2, num_tokens=100, seed=3), 2.0, 2)


def test_layout_slots_and_trace_files(files, tmp_path, capsys):
    layout = json.loads(files["l16"].read_text())
    for bad in (None, 1.5, "0", True):
        layout["layers"][0]["slots"][1][0] = bad
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(layout))
        err = _error(capsys, ["simulate", "--trace", str(files["t16"]), "--layout", str(path)])
        assert f"layers[0].slots[1] holds {bad!r}" in err
    np.save(tmp_path / "a.npy", np.zeros((1, 4, 2), dtype=np.int64))
    assert "a single array (.npy)" in _error(capsys, ["trace", "info", str(tmp_path / "a.npy")])
    (tmp_path / "text.npz").write_text("hello")
    assert "not an .npz archive" in _error(capsys, ["trace", "info", str(tmp_path / "text.npz")])


def test_simulate_flags(files, capsys):
    base = ["simulate", "--trace", str(files["t16"]), "--layout", str(files["l16"])]
    # 100 tokens per source rank: a 101st step would have none
    assert "steps=101 exceeds the tokens of the busiest source rank (100)" in _error(
        capsys, [*base, "--replay", "--steps", "101"])
    assert "--stage2: for --replay only" in _error(capsys, [*base, "--stage2", "interval"])
    # flags given at their default value are not silently ignored either
    assert "--steps, --stage2: for --replay only" in _error(capsys, [*base, "--stage2", "step", "--steps", "16"])
    assert "--capacity-factor: for the step-time model only" in _error(capsys, [*base, "--capacity-factor", "1.25"])
    assert "--replay: not with the step-time model" in _error(
        capsys, [*base, "--replay", "--hardware", "H100", "--model-shape", "mixtral"])
    assert "--trace: not with --synth-gpus" in _error(
        capsys, ["simulate", "--trace", str(files["t16"]), "--synth-gpus", "8", "--hardware", "H100",
                 "--model-shape", "mixtral"])
    assert "--model-shape: for the step-time model only" in _error(capsys, [*base, "--model-shape", "qwen"])
    hw = [*base, "--hardware", "H100", "--model-shape", "mixtral"]
    assert "--hidden must be >= 1, got -1" in _error(capsys, [*hw, "--hidden", "-1"])
    assert "--capacity-factor must be >= 0" in _error(capsys, [*hw, "--capacity-factor", "-1"])
    assert main([*base, "--replay", "--steps", "4", "--json"]) == 0
    capsys.readouterr()


def test_replay_prices_migrations_with_the_given_sizes(tmp_path, capsys):
    trace, layout = tmp_path / "t.npz", tmp_path / "l.json"
    save_trace(synth_trace(num_experts=16, top_k=2, num_tokens=8000, clustering=0.8, seed=5), trace)
    save_layout(contiguous_layout(16, 2, 2), layout)
    base = ["simulate", "--trace", str(trace), "--layout", str(layout), "--replay", "--json"]
    migrations = []
    for sizes in ([], ["--expert-params", "1000", "--hidden-bytes", "256"]):
        assert main([*base, *sizes]) == 0
        migrations.append(json.loads(capsys.readouterr().out)["migrations"])
    assert migrations[0] == 0 < migrations[1]  # a 17.3M-parameter expert never pays on this trace; a tiny one does


def test_report_and_compare_name_bad_files(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "layout_changes.jsonl").write_text('{"step": 3, "moved": 2}\n{"step": "x"}\n')
    assert "layout_changes.jsonl:2: expected an object with an int 'step'" in _error(capsys, ["report", str(run)])
    assert not (run / "report").exists()  # checked before anything is written
    runs = tmp_path / "e2e"
    shutil.copytree(REPO / "tests" / "data" / "e2e_default", runs, ignore=shutil.ignore_patterns("repeats"))
    for d in runs.glob("*-deepspeed"):
        shutil.rmtree(d)
    assert "no <rate>-deepspeed run" in _error(capsys, ["calibrate", "--compare", str(runs)])
    metrics = runs / "1gbit-cobalt" / "metrics.json"
    data = json.loads(metrics.read_text())
    del data["step_times_s"]
    metrics.write_text(json.dumps(data))
    assert "1gbit-cobalt/metrics.json: missing step_times_s" in _error(capsys, ["calibrate", "--compare", str(runs)])


def test_calibrate_checks_its_flags_before_measuring(tmp_path, capsys):
    out = tmp_path / "hw.json"
    for argv, message in ((["--ranks-per-node", "0"], "--ranks-per-node must be >= 1, got 0"),
                          (["--world", "0"], "--world must be >= 2, got 0"),
                          (["--world", "3"], "--world 3 is not a multiple of --ranks-per-node 2"),
                          (["--default-rate", "fast"], "--default-rate: rate 'fast': expected a tc rate"),
                          (["--rates", "1gbit", "5xbit"], "--rates: rate '5xbit'")):
        assert message in _error(capsys, ["calibrate", "--skip-link", *argv, "--out", str(out)])
    assert not out.exists()


def test_plan_takes_any_integer_seed(files, tmp_path, capsys):
    # Mt-KaHyPar, one of stage 1's seeds, takes a C int: larger seeds are folded into its range
    for seed in (2**31, 2**40, -5):
        out = tmp_path / f"l{seed}.json"
        assert main(["plan", "--trace", str(files["t16"]), "--nodes", "2", "--gpus-per-node", "2", "--seed", str(seed),
                     "--out", str(out)]) == 0 and out.exists()
    capsys.readouterr()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(traffic=[1, 2]), "traffic must be an object"),
    (lambda d: d.update(final_loss=None), "final_loss must be a number, got None"),
    (lambda d: d["traffic"].pop("deepspeed_inter_node_bytes_padded"), "traffic.deepspeed_inter_node_bytes_padded is "
                                                                      "missing"),
    (lambda d: d.update(model="x"), "model must be an object"),
    (lambda d: d["model"].pop("d_model"), "model.d_model is missing"),
    (lambda d: d.update(world_size=0), "world_size must be an int >= 1, got 0"),
    (lambda d: d.update(ranks_per_node=3), "world_size 4 is not a multiple of ranks_per_node 3"),
    (lambda d: d.update(step_times_s=[]), "step_times_s must be a non-empty list of numbers"),
])
def test_hand_edited_metrics_are_named_not_a_traceback(tmp_path, capsys, edit, message):
    runs = tmp_path / "e2e"
    shutil.copytree(REPO / "tests" / "data" / "e2e_default", runs, ignore=shutil.ignore_patterns("repeats"))
    metrics = runs / "1gbit-cobalt" / "metrics.json"
    data = json.loads(metrics.read_text())
    edit(data)
    metrics.write_text(json.dumps(data))
    verbs = []
    if not message.startswith("final_loss"):  # the comparison does not read the loss
        verbs.append(["calibrate", "--compare", str(runs)])
    if not message.startswith("model"):  # the report does not read the model
        verbs.append(["report", str(runs)])
    for argv in verbs:
        assert f"1gbit-cobalt/metrics.json: {message}" in _error(capsys, argv)


def test_plan_prices_traffic_copies_with_the_model_sizes(tmp_path, capsys):
    from ds_cobalt.planner.layout import cross_node_copies, load_layout

    trace = tmp_path / "t.npz"
    save_trace(synth_trace(num_experts=16, top_k=2, num_tokens=4000, gini=0.3, clustering=0.6, seed=0), trace)
    base = ["plan", "--trace", str(trace), "--nodes", "4", "--gpus-per-node", "2", "--redundant-slots", "1"]
    copies = {}
    for name, price in (("free", []), ("priced", ["--expert-params", "1000000", "--hidden-bytes", "256",
                                                  "--tokens-per-step", "4000"])):
        assert main([*base, *price, "--out", str(tmp_path / f"{name}.json")]) == 0
        copies[name] = int(cross_node_copies(load_layout(tmp_path / f"{name}.json").layer(0), 16, 2).sum())
    assert copies["free"] > 0 and copies["priced"] == 0  # a 1M-parameter copy costs ~1 cross-node token per token
    out = tmp_path / "x.json"
    assert "needs --hidden-bytes, --tokens-per-step too" in _error(capsys, [*base, "--expert-params", "5", "--out",
                                                                            str(out)])
    assert "--tokens-per-step must be >= 1, got 0" in _error(
        capsys, [*base, "--expert-params", "5", "--hidden-bytes", "8", "--tokens-per-step", "0", "--out", str(out)])
    assert not out.exists()


def test_trace_info_of_a_trace_with_far_more_experts_than_used(tmp_path, capsys):
    # no [E] or [E, E] array: 2**41 experts, 4 tokens (the repeated 5 counts once, -1 is dropped)
    path = tmp_path / "huge.npz"
    np.savez(path, experts=np.array([[[0, 1], [1, 2], [5, 5], [-1, 3]]]), num_experts=np.int64(2**41))
    assert main(["trace", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"unused experts {2**41 - 5}, dropped ids 1" in out and "load gini 1.000" in out


def test_hand_written_layouts_in_any_slot_order(tmp_path, capsys):
    """DESIGN.md's layout holds its experts in any slot order: `plan --current`, `simulate --replay` and
    `--hardware` read owners from the first E / W slots of each rank, so a layout whose owners come later (or
    with an empty slot among them) is put in owner order first (`owners_first`); it used to crash inside the
    compiled kernels (out-of-bounds reads, sometimes a segfault). A layout with no owner choice is an error."""
    from ds_cobalt.planner.layout import Layout, canonical_owner_order, owners_first
    from ds_cobalt.sim.cluster import predict_step_times
    from ds_cobalt.sim.hardware import HARDWARE_PRESETS, ModelShape
    from ds_cobalt.sim.replay import replay

    trace = synth_trace(num_experts=8, top_k=2, num_tokens=800, seed=4)
    save_trace(trace, tmp_path / "t.npz")
    shapes = ([[7, 0, 1], [2, 3, -1], [4, 5, 7], [6, 7, 1]], [[-1, 0, 1], [2, 3, 4], [4, 5, 6], [6, 7, 0]],
              [[0, 1, 7], [2, -1, 3], [4, 5, -1], [6, 7, -1]])
    for slots in shapes:
        layout = Layout(8, 2, 2, np.array([slots]))
        canonical = canonical_owner_order(layout)
        assert owners_first(layout) is not layout and owners_first(canonical) is canonical
        planned = plan_layout(trace, 2, 2, 1, "cobalt", current=layout)
        assert np.array_equal(planned.slots_LWS, plan_layout(trace, 2, 2, 1, "cobalt", current=canonical).slots_LWS)
        assert replay(trace, layout, steps=4, replan_interval=2) == replay(trace, canonical, steps=4,
                                                                            replan_interval=2)
        shape = ModelShape(name="tiny", num_experts=8, top_k=2, hidden=64, ffn=128, moe_layers=1)
        pred = predict_step_times(trace, layout, HARDWARE_PRESETS["B200"], shape)
        assert pred == predict_step_times(trace, canonical, HARDWARE_PRESETS["B200"], shape)
        save_layout(layout, tmp_path / "cur.json")
        assert main(["plan", "--trace", str(tmp_path / "t.npz"), "--nodes", "2", "--gpus-per-node", "2",
                     "--redundant-slots", "1", "--current", str(tmp_path / "cur.json"),
                     "--out", str(tmp_path / "out.json")]) == 0
    # rank 2 alone holds 5, 6 and 7, but owns two experts
    save_layout(Layout(8, 2, 2, np.array([[[0, 0, 1], [2, 3, 4], [5, 6, 7], [1, 2, -1]]])), tmp_path / "cur.json")
    assert "no owner assignment" in _error(capsys, [
        "plan", "--trace", str(tmp_path / "t.npz"), "--nodes", "2", "--gpus-per-node", "2", "--redundant-slots", "1",
        "--current", str(tmp_path / "cur.json"), "--out", str(tmp_path / "out.json")])
    assert "no such file" in _error(capsys, ["simulate", "--trace", str(tmp_path / "t.npz"),
                                             "--layout", str(tmp_path / "missing.json")])
