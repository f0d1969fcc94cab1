"""Asynchronous migrations at the edges: a checkpoint loaded while one is in flight, and a re-plan that starts at
the step a migration is applied (2 gloo CPU ranks as 2 nodes of 1)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from test_migration import LAYERS, build_engine, random_owner_layout, train

ONE_PER_NODE = {"topology": {"ranks_per_node": 1}, "transport": {"schedule": "hierarchical"}}
_CALLS: list = [itertools.count()]  # plans made by this rank's policy since the last engine


def move_then_replicas(inp):
    """This rank's first plan moves owners (rolled by one rank); later plans keep the owners they are given and
    put the next rank's first owner in the spare slot (a replica-only change). Registered in the rank processes
    only (the planner tests run every registered policy)."""
    owners = inp.current_slots_WS[:, : inp.stats.num_experts // inp.current_slots_WS.shape[0]]
    if next(_CALLS[0]) == 0:
        owners = np.roll(owners, 1, axis=0)
    return np.concatenate([owners, np.roll(owners, -1, axis=0)[:, :1]], axis=1)


def _edges(rank: int, world: int, tmp: str) -> dict:
    from ds_cobalt import cobalt_layers
    from ds_cobalt.integrations.migration import migrate
    from ds_cobalt.planner import register_policy

    register_policy("test_move_then_replicas")(move_then_replicas)

    out: dict[str, Any] = {}
    # 1. load_checkpoint while an asynchronous migration is pending: the load wins, as after a plain load
    engine = build_engine("cobalt", 1, ep_size=2, cobalt=ONE_PER_NODE)
    train(engine, range(4))
    engine.save_checkpoint(tmp, tag="t")
    train(engine, range(4, 6))
    rng = np.random.default_rng(3)
    pending = migrate(engine, [random_owner_layout(rng, world=2) for _ in range(LAYERS)], asynchronous=True)
    out["pending_at_load"] = not pending.done
    engine.load_checkpoint(tmp, tag="t")
    out["after_load"] = train(engine, range(4, 8))
    engine.destroy()
    fresh = build_engine("cobalt", 1, ep_size=2, cobalt=ONE_PER_NODE)
    fresh.load_checkpoint(tmp, tag="t")
    out["fresh_load"] = train(fresh, range(4, 8))
    fresh.destroy()
    # 2. a re-plan due at the step a migration is applied plans on the owners that migration installs
    replan = {"planner": {"replan_interval": 2, "apply_lag": 1, "first_replan_step": 1, "worker": "thread",
                          "policy": "test_move_then_replicas", "redundant_slots": 1}}
    for asynchronous in (False, True):
        _CALLS[0] = itertools.count()
        cfg = {**ONE_PER_NODE, **replan, "migration": {"ignore_cost_model": True, "asynchronous": asynchronous}}
        engine = build_engine("cobalt", 1, ep_size=2, cobalt=cfg)
        # plans after steps 1, 2, 4 and 6, each applied a step later: none is in flight at the end (a thread
        # planning then would call the policy after the counter is reset for the next engine)
        out[f"replan_async={asynchronous}"] = train(engine, range(7))
        out[f"migrations_async={asynchronous}"] = sum(bool(m.moved) for m in engine.cobalt_migrations)
        out[f"layouts_async={asynchronous}"] = [layer.layout_slots.tolist() for layer in cobalt_layers(engine)]
        engine.destroy()
    return out


def test_async_migration_edges(run_ranks: Any, tmp_path) -> None:
    res = run_ranks(_edges, 2, str(tmp_path), ranks_per_node=1, timeout=240)
    for r in res:
        assert r["pending_at_load"]
        np.testing.assert_allclose(r["after_load"], r["fresh_load"], rtol=1e-6, atol=1e-7)
        assert r["migrations_async=True"] == r["migrations_async=False"] == 1
        assert r["layouts_async=True"] == r["layouts_async=False"]
        np.testing.assert_allclose(r["replan_async=True"], r["replan_async=False"], rtol=1e-5, atol=1e-6)
