"""Exact resume: a run resumed from a checkpoint continues bit for bit like the uninterrupted run, with
re-planning, replicas and owner migrations on, under ZeRO 1 and 2 for `ds_cobalt.MoE`, and under ZeRO 1 for
DeepSpeed's AutoEP layers (a tiny Mixtral, tests/integrations/test_auto_ep.py) (4 gloo CPU ranks, 2 nodes x 2).

The checkpoints are taken at step 5 (a plan gathered after step 4 is still in flight: the resumed run must submit
it again and apply it at step 6), step 10 (the re-plan applied at step 10 started an asynchronous migration that
the save commits first; the statistics of steps 9-10 must come back for the plan after step 12) and step 15. The
replanner's part of a checkpoint is `cobalt_replan_rank*.safetensors` (integrations/replan_state.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from test_migration import build_engine, train

STEPS, SAVE_EVERY = 16, 5
# fixed choices (schedule, stage 2): a timed `auto` choice may differ between runs, and with it summation orders
COBALT = {"planner": {"replan_interval": 4, "apply_lag": 2, "redundant_slots": 1, "policy": "test_slow_shuffle",
                      "stage2": "step"},
          "migration": {"ignore_cost_model": True}, "transport": {"schedule": "hierarchical"}}


def _run(engine, steps: range, save_dir: str | None = None, train_step=None) -> dict:
    from ds_cobalt.integrations.engine import cobalt_layers

    losses, layouts = [], []
    for step in steps:
        losses += (train_step or train)(engine, range(step, step + 1))
        layouts.append([layer.layout_slots.tolist() for layer in cobalt_layers(engine)])
        if save_dir is not None and engine.global_steps % SAVE_EVERY == 0:
            engine.save_checkpoint(save_dir)
    replans = [(m.step, sorted({mv[:2] for mv in m.moved})) for m in engine.cobalt_migrations
               if m.reason.startswith("replan")]
    import ds_cobalt

    # layer forwards whose spare slots were refilled from their own loads (stage 2 every step)
    stage2 = ds_cobalt.balance_summary(engine.module)["forwards"]
    return {"losses": losses, "layouts": layouts, "replans": replans, "stage2_forwards": stage2}


def _resume(rank: int, world: int, root: str) -> dict:
    import slow_policy  # noqa: F401 - registers test_slow_shuffle (random owners, a replica per rank)

    out: dict[str, Any] = {}
    for stage in (1, 2):
        save_dir = os.path.join(root, f"zero{stage}")
        engine = build_engine("cobalt", stage, cobalt=COBALT)
        out[f"full{stage}"] = _run(engine, range(STEPS), save_dir)
        engine.destroy()
        for start in (5, 10):
            engine = build_engine("cobalt", stage, cobalt=COBALT)
            engine.load_checkpoint(save_dir, tag=f"global_step{start}")
            assert engine.global_steps == start
            out[f"resumed{stage}_{start}"] = _run(engine, range(start, STEPS))
            engine.destroy()
    # The AutoEP path: DeepSpeed's AutoEP layers (tiny Mixtral) under ds_cobalt, ZeRO 1, resumed from step 5.
    from test_auto_ep import _data, _engine, _steps

    data = _data(rank)
    autoep_cobalt = {"topology": {"ranks_per_node": 2}, **COBALT}
    save_dir = os.path.join(root, "autoep")
    engine = _engine("mixtral", 1, autoep_cobalt)
    out["autoep_full"] = _run(engine, range(STEPS), save_dir, lambda e, r: _steps(e, data, r))
    engine.destroy()
    engine = _engine("mixtral", 1, autoep_cobalt)
    engine.load_checkpoint(save_dir, tag="global_step5")
    out["autoep_resumed"] = _run(engine, range(5, STEPS), None, lambda e, r: _steps(e, data, r))
    engine.destroy()
    return out


def test_resumed_run_matches_uninterrupted_bit_for_bit(run_ranks: Any, tmp_path) -> None:
    res = run_ranks(_resume, 4, str(tmp_path), ranks_per_node=2, timeout=420)
    for r in res:
        for stage in (1, 2):
            full = r[f"full{stage}"]
            assert [step for step, _ in full["replans"]] == [6, 10, 14]  # the plans really move owners
            assert full["stage2_forwards"] > 0  # and leave spare slots that every forward refills
            for start in (5, 10):
                resumed = r[f"resumed{stage}_{start}"]
                assert resumed["losses"] == full["losses"][start:]  # bit for bit
                assert resumed["layouts"] == full["layouts"][start:]
                assert resumed["replans"] == [p for p in full["replans"] if p[0] > start]
        full, resumed = r["autoep_full"], r["autoep_resumed"]
        assert [step for step, _ in full["replans"]] == [6, 10, 14] and full["stage2_forwards"] > 0
        assert resumed["losses"] == full["losses"][5:] and resumed["layouts"] == full["layouts"][5:]
        assert resumed["replans"] == [p for p in full["replans"] if p[0] > 5]
    assert os.path.exists(tmp_path / "zero1" / "global_step5" / "cobalt_replan_rank3.safetensors")


# ------------------------------------------------------------------ file errors (one process, no ranks)
def _fake_engine():
    class Hook:
        layers = [SimpleNamespace(num_experts=8)] * 2

        def state(self):
            return {}, {}

        def restore(self, tensors, meta):
            raise KeyError("stats.0.load_E")

    return SimpleNamespace(cobalt_step_hooks=[Hook()], global_steps=3)


@pytest.mark.parametrize("content", ["truncated", "foreign", "inconsistent"])
def test_bad_replan_state_file_is_an_error_naming_it(tmp_path, content: str) -> None:
    import torch
    from safetensors.torch import save_file

    from ds_cobalt.integrations.replan_state import load_replan_state, replan_state_path, save_replan_state

    engine = _fake_engine()
    path = replan_state_path(tmp_path, 0)
    if content == "truncated":
        save_replan_state(engine, tmp_path)
        path.write_bytes(path.read_bytes()[:20])
        match = "unreadable replanner state"
    elif content == "foreign":
        save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "something-else"})
        match = "not a ds_cobalt replanner state"
    else:
        save_replan_state(engine, tmp_path)
        match = r"inconsistent replanner state \(KeyError"
    with pytest.raises(ValueError, match=match) as err:
        load_replan_state(engine, tmp_path)
    assert str(path) in str(err.value)
    assert not load_replan_state(engine, tmp_path / "elsewhere")  # no file: start fresh
