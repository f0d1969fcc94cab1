"""Activation checkpointing around ds_cobalt's MoE layers (`torch.utils.checkpoint`, reentrant or not): the
recomputation inside backward repeats its forward's schedule, replica mode and overlap settings, and counts and
times nothing (`LayerCore.run`). Before, it picked again: `auto`'s trials advanced twice a step (forward to
recomputation), forwards and routing statistics were counted twice, and a recomputation that ran another schedule
than its forward failed non-reentrant checkpointing ("Recomputed values ... have different metadata").
4 gloo CPU ranks as 2 nodes x 2, the model of tests/integrations/test_migration.py.
"""

from __future__ import annotations

import pytest

STEPS = 10


def _checkpointed(engine, mode: str) -> None:
    """Wrap every MoE layer's forward of `engine` in `torch.utils.checkpoint` (`mode`: reentrant or not)."""
    import torch.utils.checkpoint as tc

    for moe in engine.module.moes:
        moe.forward = (lambda f: lambda h: tc.checkpoint(f, h, use_reentrant=mode == "reentrant"))(moe.forward)


def _run(impl: str, mode: str | None, cobalt: dict) -> dict:
    from test_migration import build_engine, train

    import ds_cobalt
    from ds_cobalt.integrations.layers import layer_cores

    engine = build_engine(impl, 1, cobalt=cobalt)
    if mode is not None:
        _checkpointed(engine, mode)
    out = {"losses": train(engine, range(STEPS))}
    if impl == "cobalt":
        cores = layer_cores(engine)
        out |= {"forwards": [c.forwards for c in cores],
                "schedule_forwards": [dict(c.schedule_forwards) for c in cores],
                "history": [[(h["forward"], h["schedule"]) for h in c.schedule_history] for c in cores],
                "overlap": [c.tuner.chosen() for c in cores],
                "steps_counted": ds_cobalt.traffic_summary(engine)["steps"]}
    engine.destroy()
    return out


def _auto_body(rank: int, world: int) -> dict:
    import itertools

    from ds_cobalt.runtime import tile_tuner

    # every timed window lasts 10 s, so `auto`'s choices do not depend on this machine's timing
    clock = itertools.count()
    tile_tuner.StepTimedChoice._now = staticmethod(lambda device: 10.0 * next(clock))
    bare = {"planner": {"replan_interval": 0}}
    return {mode: _run("cobalt", mode, bare) for mode in (None, "reentrant", "non_reentrant")} | {
        "deepspeed": _run("deepspeed", "non_reentrant", {})}


def test_checkpointed_auto_runs_as_without(run_ranks) -> None:
    import numpy as np

    for out in run_ranks(_auto_body, 4, ranks_per_node=2, timeout=300):
        plain = out[None]
        assert plain["forwards"] == [STEPS, STEPS]
        for mode in ("reentrant", "non_reentrant"):
            run = out[mode]
            np.testing.assert_allclose(run["losses"], out["deepspeed"]["losses"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(run["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
            for key in ("forwards", "schedule_forwards", "history"):
                assert run[key] == plain[key], (mode, key, run[key], plain[key])


def _overlap_body(rank: int, world: int) -> dict:
    tuned = {"transport": {"schedule": "hierarchical"}, "planner": {"replan_interval": 0},
             "overlap": {"enabled": "auto", "tile_rows": "auto", "rail_chunks": "auto"}}
    out = {"cobalt": _run("cobalt", "reentrant", tuned), "deepspeed": _run("deepspeed", "reentrant", {})}
    try:
        _run("cobalt", "non_reentrant", tuned)
    except ValueError as e:  # every rank, in its first forward
        out["non_reentrant_error"] = str(e)
    return out


def test_checkpointed_overlap_tuning_replays_its_settings(run_ranks) -> None:
    """The overlap tuner times tile sizes, rail chunks and overlapped against phased over the first forwards; each
    recomputation cuts the tiles and chunks of its own forward. Reentrant checkpointing only (DeepSpeed's
    `deepspeed.checkpointing` is reentrant): the non-reentrant form recomputes lazily, from inside the overlapped
    backward's per-tile exchanges, at points that differ between ranks (README, Known limits): it is an error that
    names the key, raised on every rank in the first forward."""
    import numpy as np

    for out in run_ranks(_overlap_body, 4, ranks_per_node=2, timeout=300):
        cobalt = out["cobalt"]
        np.testing.assert_allclose(cobalt["losses"], out["deepspeed"]["losses"], rtol=1e-5, atol=1e-6)
        assert cobalt["forwards"] == [STEPS, STEPS]
        assert cobalt["schedule_forwards"] == [{"hierarchical": STEPS}] * 2
        assert all(chosen["tile_rows"] is not None for chosen in cobalt["overlap"]), cobalt["overlap"]
        assert "cobalt.overlap.enabled='auto' does not work under non-reentrant" in out["non_reentrant_error"]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_in_backward_sees_the_recomputation(use_reentrant: bool) -> None:
    """`layer._in_backward` (autograd's graph task of this thread) is what tells a recomputation apart."""
    import torch
    import torch.utils.checkpoint as tc

    from ds_cobalt.runtime.layer import _in_backward

    seen = []

    def body(x):
        seen.append(_in_backward())
        return (x * x).sin()  # saves x: the non-reentrant form recomputes it in backward

    x = torch.ones(3, requires_grad=True)
    tc.checkpoint(body, x, use_reentrant=use_reentrant).sum().backward()
    assert seen == [False, True] and not _in_backward()


def test_lazy_recompute_seen_only_under_the_non_reentrant_form() -> None:
    """`layer._lazy_recompute_active`: true in a forward under `use_reentrant=False` only (not in a plain forward,
    the reentrant form, or activations offloaded to the host without checkpointing)."""
    import torch
    import torch.utils.checkpoint as tc

    from ds_cobalt.runtime.layer import _lazy_recompute_active

    seen = []

    def body(x):
        seen.append(_lazy_recompute_active())
        return (x * x).sin()

    x = torch.ones(3, requires_grad=True)
    body(x)
    tc.checkpoint(body, x, use_reentrant=True).sum().backward()
    with torch.autograd.graph.save_on_cpu():
        body(x)
    first = len(seen)
    tc.checkpoint(body, x, use_reentrant=False).sum().backward()
    assert seen[:first] == [False] * first and seen[first] is True
