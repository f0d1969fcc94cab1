"""Checkpoints in logical expert order through `engine.save_checkpoint` / `load_checkpoint`: ds_cobalt (non-
contiguous layout with replicas) -> vanilla DeepSpeed MoE, vanilla -> ds_cobalt, ds_cobalt -> ds_cobalt with
its layout restored, and 4 ranks (2 nodes x 2) -> 2 ranks (1 node). 4 gloo CPU ranks."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from test_migration import LAYERS, E, build_engine, random_owner_layout, train


def _layouts(engine) -> list[np.ndarray]:
    from ds_cobalt.integrations.engine import cobalt_layers

    return [layer.layout_slots.copy() for layer in cobalt_layers(engine)]


def _decisions(core) -> dict:
    """What a resume must carry of `auto`'s state for a layer (the rest is re-timed where a timing was running)."""
    state = core.decision_state()
    return {key: state[key] for key in ("schedule", "kept", "owner_moves_judged", "owner_moves_priced",
                                        "schedule_history", "overlap")}


def _round_trips(rank: int, world: int, stage: int, root: str) -> dict:
    import torch

    import ds_cobalt
    from ds_cobalt.integrations.layers import layer_cores
    from ds_cobalt.integrations.migration import migrate

    out: dict[str, Any] = {}
    cobalt_dir, vanilla_dir = os.path.join(root, "cobalt"), os.path.join(root, "vanilla")
    # ds_cobalt, moved to a non-contiguous layout with a replica per rank, saves at step 6.
    engine = build_engine("cobalt", stage)
    train(engine, range(4))
    rng = np.random.default_rng(11)
    owners = [random_owner_layout(rng) for _ in range(LAYERS)]
    assert migrate(engine, [np.concatenate([o, o[[2, 3, 0, 1], :1]], axis=1) for o in owners]).ok
    train(engine, range(4, 6))
    saved_layouts = _layouts(engine)
    with ds_cobalt.logical_order(engine):  # a state dict with DeepSpeed's meaning (this rank's experts r*E/W...)
        exported = {key: value.clone() for key, value in engine.module.state_dict().items()}
    out["layout_kept_after_export"] = all(np.array_equal(a, b) for a, b in zip(saved_layouts, _layouts(engine)))
    # `auto`'s decisions ride along: layer 0 settled on dense (untimed), layer 1 with the gate's verdict and a tile
    # size its overlap tuner chose
    cores = layer_cores(engine)
    cores[0].settle_dense(0.05)
    cores[1].owner_moves_judged = cores[1].owner_moves_priced = True
    cores[1].tuner.tiles.chosen = 64
    saved_decisions = [_decisions(core) for core in cores]
    choosers = [core._chooser for core in cores]
    engine.save_checkpoint(cobalt_dir, tag="s6")
    out["layout_kept_after_save"] = all(np.array_equal(a, b) for a, b in zip(saved_layouts, _layouts(engine)))
    # the round trip to logical order re-timed nothing: the same choosers go on
    out["decisions_kept_after_save"] = all(core._chooser is c for core, c in zip(layer_cores(engine), choosers))
    out["ref_cobalt"] = train(engine, range(6, 10))
    engine.destroy()
    # vanilla DeepSpeed resumes the ds_cobalt checkpoint, then saves its own at step 6.
    engine = build_engine("deepspeed", stage)
    engine.load_checkpoint(cobalt_dir, tag="s6")
    vanilla = engine.module.state_dict()
    out["export_is_deepspeeds"] = exported.keys() == vanilla.keys() and all(
        torch.equal(exported[key], vanilla[key]) for key in vanilla)
    out["vanilla_from_cobalt"] = train(engine, range(6, 10))
    engine.save_checkpoint(vanilla_dir, tag="s10")
    out["ref_vanilla"] = train(engine, range(10, 14))
    engine.destroy()
    # ds_cobalt resumes the vanilla checkpoint (contiguous layout) ...
    engine = build_engine("cobalt", stage)
    engine.load_checkpoint(vanilla_dir, tag="s10")
    out["contiguous_after_vanilla"] = all(np.array_equal(s, np.arange(E).reshape(4, 2)) for s in _layouts(engine))
    out["cobalt_from_vanilla"] = train(engine, range(10, 14))
    # ... and its own, restoring the saved layout.
    engine.load_checkpoint(cobalt_dir, tag="s6")
    out["layout_restored"] = all(np.array_equal(a, b) for a, b in zip(saved_layouts, _layouts(engine)))
    out["decisions_restored"] = [_decisions(core) for core in layer_cores(engine)] == saved_decisions
    out["cobalt_from_cobalt"] = train(engine, range(6, 10))
    engine.destroy()
    # module only, at the sizes that saved it: DeepSpeed's semantics (each engine keeps its own, fresh optimizer)
    for impl in ("cobalt", "deepspeed"):
        engine = build_engine(impl, stage)
        engine.load_checkpoint(cobalt_dir, tag="s6", load_module_only=True)
        out[f"module_only_{impl}"] = train(engine, range(6, 10))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_round_trips_with_vanilla_deepspeed(run_ranks: Any, tmp_path, stage: int) -> None:
    res = run_ranks(_round_trips, 4, stage, str(tmp_path), ranks_per_node=2, timeout=240)
    for r in res:
        assert r["layout_kept_after_save"] and r["contiguous_after_vanilla"] and r["layout_restored"]
        assert r["decisions_kept_after_save"] and r["decisions_restored"]
        assert r["layout_kept_after_export"] and r["export_is_deepspeeds"]
        np.testing.assert_allclose(r["vanilla_from_cobalt"], r["ref_cobalt"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["cobalt_from_cobalt"], r["ref_cobalt"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["cobalt_from_vanilla"], r["ref_vanilla"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["module_only_cobalt"], r["module_only_deepspeed"], rtol=1e-5, atol=1e-6)
        assert not np.allclose(r["module_only_cobalt"], r["ref_cobalt"], rtol=1e-4, atol=0)  # no optimizer state
    # DeepSpeed's own file names, one per logical expert
    names = os.listdir(tmp_path / "cobalt" / "s6")
    assert all(f"layer_{l}_expert_{e}_mp_rank_00_model_states.pt" in names for l in range(LAYERS) for e in range(E))


def _full_state(engine) -> dict:
    """Key (logical expert ids) -> full fp32 row (weight, master, moments) of what this rank holds."""
    from ds_cobalt.integrations.migration import ExpertStateIO
    from ds_cobalt.integrations.portable import _group_steps, _keyed_parameters

    rows = {key: ExpertStateIO(engine, piece[0]).read([piece]).numpy().copy()
            for key, piece, _ in _keyed_parameters(engine)}
    return {"rows": rows, "group_steps": _group_steps(engine)}


def _save_at_4(rank: int, world: int, root: str, stage: int) -> dict:
    from ds_cobalt.integrations.migration import migrate

    engine = build_engine("cobalt", stage)
    train(engine, range(3))
    rng = np.random.default_rng(3)
    assert migrate(engine, [random_owner_layout(rng) for _ in range(LAYERS)]).ok
    engine.save_checkpoint(root, tag="w4")
    return _full_state(engine)


def _resume_at_2(rank: int, world: int, root: str, stage: int) -> dict:
    out: dict[str, Any] = {}
    for impl in ("cobalt", "deepspeed"):
        engine = build_engine(impl, stage, ep_size=2)
        if impl == "cobalt":
            try:  # DeepSpeed's format cannot repartition optimizer state to a new world size
                engine.load_checkpoint(root, tag="w4")
                out["optimizer_load_error"] = None
            except Exception as err:  # noqa: BLE001
                out["optimizer_load_error"] = f"{type(err).__name__}: {err}"
        engine.load_checkpoint(root, tag="w4", load_module_only=True)  # + ds_cobalt's portable state
        if impl == "cobalt":
            out["state"] = _full_state(engine)
            out["global_steps"] = engine.global_steps
        out[impl] = train(engine, range(3, 6))
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_4_ranks_to_2_ranks_with_optimizer_state(run_ranks: Any, tmp_path, stage: int) -> None:
    saved = run_ranks(_save_at_4, 4, str(tmp_path), stage, ranks_per_node=2, timeout=120)
    res = run_ranks(_resume_at_2, 2, str(tmp_path), stage, ranks_per_node=2, timeout=120)
    before = {k: v for r in saved for k, v in r["rows"].items()}
    for r in res:
        assert r["optimizer_load_error"] is not None  # DeepSpeed alone cannot load its optimizer state here
        # weights, fp32 master copies and Adam moments of every parameter, by logical expert, bit for bit
        for key, row in r["state"]["rows"].items():
            np.testing.assert_array_equal(row, before[key], err_msg=key)
        assert r["state"]["group_steps"] == saved[0]["group_steps"] and r["global_steps"] == 3
        # vanilla DeepSpeed loads the same weights: the first loss (before any update) agrees
        np.testing.assert_allclose(r["cobalt"][0], r["deepspeed"][0], rtol=1e-5, atol=1e-6)
        assert np.isfinite(r["cobalt"]).all()
    assert len({k for r in res for k in r["state"]["rows"]}) == len(before)  # every parameter came back
