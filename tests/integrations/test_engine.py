"""`CobaltEngine`: what `ds_cobalt.initialize` returns, with its step and checkpoint behaviour as methods, and what
a plain `deepspeed.initialize` engine does not get."""

from __future__ import annotations

import pytest
from test_migration import MICRO, build_engine, random_owner_layout, train


def _engine_body(rank: int, world: int) -> dict:
    import numpy as np
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_cobalt import CobaltEngine, cobalt_layers
    from ds_cobalt.integrations.layers import layer_cores
    from ds_cobalt.integrations.migration import migrate

    out: dict = {}
    engine = build_engine("cobalt", 0, cobalt={"planner": {"replan_interval": 4, "apply_lag": 1}})
    out["types"] = (isinstance(engine, CobaltEngine), isinstance(engine, DeepSpeedEngine))
    out["patched"] = sorted(k for k in ("step", "save_checkpoint", "load_checkpoint") if k in vars(engine))
    out["hooks"] = [type(h).__name__ for h in engine.cobalt_step_hooks]
    out["planning"] = [core.stats.planning for core in layer_cores(engine)]
    out["same_layers"] = [layer.cobalt_core is core for layer, core in zip(cobalt_layers(engine), layer_cores(engine))]
    train(engine, range(2))  # (before `auto`'s first choices: a layer settled on dense counts load only)
    out["replan_samples"] = int(sum(float(core.stats.coact_EE.sum()) for core in layer_cores(engine)))
    train(engine, range(2, 6))
    pending = migrate(engine, [random_owner_layout(np.random.default_rng(3)) for _ in range(2)], asynchronous=True)
    train(engine, range(6, 7))  # the forward commits each layer, the step would flush the rest
    out["pending_ok"] = bool(pending.done and pending.report is not None and pending.report.ok)
    # E=8 on 4 ranks: a rank holds at most 8 - 2 experts besides its own two
    with pytest.raises(ValueError, match=r"cobalt.planner.redundant_slots=7 .* at most .* = 6"):
        build_engine("cobalt", 0, cobalt={"planner": {"replan_interval": 4, "redundant_slots": 7}})
    out["too_many_spares_refused"] = True
    return out


def _plain_body(rank: int, world: int) -> dict:
    import numpy as np

    from ds_cobalt import CobaltEngine
    from ds_cobalt.integrations.layers import layer_cores
    from ds_cobalt.integrations.migration import migrate

    engine = build_engine("cobalt", 0, cobalt={"topology": {"ranks_per_node": 2}}, plain_initialize=True)
    out = {"cobalt_engine": isinstance(engine, CobaltEngine)}
    train(engine, range(2))
    out["planning"] = [core.stats.planning for core in layer_cores(engine)]
    out["coact"] = float(sum(float(core.stats.coact_EE.sum()) for core in layer_cores(engine)))
    # a plain engine's checkpoints would write moved experts under other experts' names: no migration at all
    for asynchronous in (True, False):
        with pytest.raises(ValueError, match="migrate needs the engine ds_cobalt.initialize returns"):
            migrate(engine, [random_owner_layout(np.random.default_rng(5)) for _ in range(2)],
                    asynchronous=asynchronous)
    out["refused"] = True
    return out


def test_initialize_returns_a_cobalt_engine_with_methods(run_ranks) -> None:
    for out in run_ranks(_engine_body, 4, ranks_per_node=2, timeout=300):
        assert out["types"] == (True, True)
        assert out["patched"] == []  # behaviour comes from the class, not from attributes on the instance
        assert out["hooks"] == ["ScheduleGate", "Replanner"]
        assert out["planning"] == [True, True]  # a replanner reads co-activation, so it is counted
        assert out["same_layers"] == [True, True]
        assert out["replan_samples"] > 0
        assert out["pending_ok"]
        assert out["too_many_spares_refused"]


def test_plain_engine_counts_no_coactivation_and_refuses_migration(run_ranks) -> None:
    for out in run_ranks(_plain_body, 4, ranks_per_node=2, timeout=300):
        assert out["cobalt_engine"] is False
        assert out["planning"] == [False, False] and out["coact"] == 0.0
        assert out["refused"]


def test_monitor_hook_writes_schedule_decisions_and_traffic() -> None:
    """DeepSpeed's monitor gets each layer's schedule once, when decided, and the counters every interval."""
    import types

    import torch

    import ds_cobalt
    from ds_cobalt.integrations.cobalt_engine import MonitorHook

    torch.manual_seed(0)
    layer = ds_cobalt.MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)
    layer(torch.randn(6, 8))
    written: list = []
    monitor = types.SimpleNamespace(enabled=True, write_events=written.extend)
    engine = types.SimpleNamespace(module=torch.nn.Sequential(layer), global_rank=0, global_steps=1, monitor=monitor)
    hook = MonitorHook(interval=2)
    hook(engine)
    assert written == [("ds_cobalt/schedule/layer0", 2.0, 1)]  # dense, the only candidate on one rank
    engine.global_steps = 2
    hook(engine)  # no new decision; the counters at the interval
    names = {name for name, _, step in written[1:]}
    assert "ds_cobalt/traffic/inter_node_bytes" in names and "ds_cobalt/traffic/layers_dense" in names
    assert dict((n, v) for n, v, _ in written[1:])["ds_cobalt/traffic/layers_dense"] == 1.0
    # one candidate: decided in the first forward, without trials
    assert ds_cobalt.schedule_summary(engine.module) == [{"layer": 0, "schedule": "dense", "timings_s": {},
                                                         "model": {}, "stage2": None, "history": [
                                                             {"forward": 1, "schedule": "dense",
                                                              "timings_s": {}, "model": {}}],
                                                         "stage2_history": [], "overlap": None}]


def _default_body(rank: int, world: int) -> dict:
    import numpy as np

    from ds_cobalt.integrations.engine import cobalt_layers
    from ds_cobalt.integrations.replan import Replanner
    from ds_cobalt.integrations.schedule_gate import ScheduleGate

    steps = range(57)
    engine = build_engine("deepspeed", 1)
    out = {"deepspeed": train(engine, steps)}
    engine.destroy()
    # a bare section (build_engine adds only ranks_per_node), and one that pins a layout-sensitive schedule
    for name, cobalt in (("auto", {}), ("hierarchical", {"transport": {"schedule": "hierarchical"}})):
        engine = build_engine("cobalt", 1, cobalt=cobalt)
        out[name] = train(engine, steps)
        (hook,) = [h for h in engine.cobalt_step_hooks if isinstance(h, Replanner)]
        out[f"{name}_history"] = [(h["planned_after_step"], h["step"], h["planned"], h["dense_skipped"],
                                   h["before_trials"]) for h in hook.history]
        out[f"{name}_dense_skips"] = list(hook.dense_skips)
        out[f"{name}_gate"] = [g.decisions for g in engine.cobalt_step_hooks if isinstance(g, ScheduleGate)]
        out[f"{name}_deferred"] = list(hook.deferred)
        out[f"{name}_slots"] = [layer.layout_slots.copy() for layer in cobalt_layers(engine)]
        out[f"{name}_schedules"] = [layer.cobalt_core.schedule for layer in cobalt_layers(engine)]
        out[f"{name}_forwards"] = [dict(layer.cobalt_core.schedule_forwards) for layer in cobalt_layers(engine)]
        # a new layout (here: the same one installed again) times only the schedule kept so far (the last decision:
        # a migration in the last steps may leave a re-timing running) against dense; dense's earlier time is carried
        # over (`known`) only after a clear win (`owners_may_move`), else dense is timed again
        out[f"{name}_next_candidates"], out[f"{name}_timed_dense"], out[f"{name}_kept"] = [], [], []
        out[f"{name}_inherited_model"], out[f"{name}_decisions"], out[f"{name}_clear"] = [], [], []
        for layer in cobalt_layers(engine):
            out[f"{name}_timed_dense"].append(layer.cobalt_core._dense_seconds is not None)
            out[f"{name}_kept"].append(layer.cobalt_core._kept_schedule)
            out[f"{name}_clear"].append(layer.cobalt_core.owners_may_move)
            out[f"{name}_decisions"].append(list(layer.cobalt_core.schedule_history))
            predicted = dict(layer.cobalt_core._chooser.predicted)
            layer.cobalt_core.install_layout(layer.layout_slots.copy())
            chooser = layer.cobalt_core._chooser
            out[f"{name}_next_candidates"].append((list(chooser.candidates), dict(chooser.known)))
            out[f"{name}_inherited_model"].append(chooser.predicted == predicted != {})
        engine.destroy()
    # a plan step while `auto` still times the schedules: the re-plan waits until every layer has chosen
    engine = build_engine("cobalt", 1, cobalt={"planner": {"replan_interval": 20, "first_replan_step": 2,
                                                           "apply_lag": 1}})
    chosen_after: list[bool] = []  # [g]: every layer's schedule chosen after optimizer step g (the hook's view)

    def record(engine, step: int) -> None:
        chosen_after.append(all(layer.cobalt_core.schedule is not None for layer in cobalt_layers(engine)))

    out["early_losses"] = train(engine, range(16), before_step=record)
    (hook,) = [h for h in engine.cobalt_step_hooks if isinstance(h, Replanner)]
    out["early"] = {"chosen_after": chosen_after, "deferred": list(hook.deferred),
                    "dense_skips": list(hook.dense_skips),
                    "starts": [h["planned_after_step"] for h in hook.history if not h["before_trials"]]}
    engine.destroy()
    # a slow link (the probe's cross-node rate replaced by 0.4 Mbit/s, for the tiny rows here): the cost model
    # prices the layout-dependent schedules below dense, so the layers are planned after step 1 and their layout is
    # applied after step 3, before their trials start
    # (the replanner's probe too: its plans price traffic copies on the same link as the layers' cost model)
    import ds_cobalt.integrations.replan as replan_module
    import ds_cobalt.runtime.layer as layer_module
    from ds_cobalt.runtime.link_probe import LinkCosts

    real_probe = layer_module.probe_links

    def slow_probe(groups, device, *args, **kwargs):
        costs = real_probe(groups, device, *args, **kwargs)
        return LinkCosts(fixed_s=costs.fixed_s, inter_node_bytes_per_s=5e4,
                         intra_node_bytes_per_s=costs.intra_node_bytes_per_s, probe_bytes=costs.probe_bytes)

    layer_module.probe_links = replan_module.probe_links = slow_probe
    try:
        engine = build_engine("cobalt", 1)
        slots: list[list] = []
        out["slow_losses"] = train(engine, range(20), before_step=lambda e, step: slots.append(
            [layer.layout_slots.copy() for layer in cobalt_layers(e)]))
    finally:
        layer_module.probe_links = replan_module.probe_links = real_probe
    (hook,) = [h for h in engine.cobalt_step_hooks if isinstance(h, Replanner)]
    out["slow"] = {"history": [(h["planned_after_step"], h["step"], h["planned"], h["before_trials"])
                               for h in hook.history],
                   "unconfirmed": [h["unconfirmed"] for h in hook.history],
                   "changed_at": [next((g for g in range(1, len(slots)) if not np.array_equal(
                       slots[g][i], slots[g - 1][i])), None) for i in range(len(slots[0]))],
                   "first_decisions": [layer.cobalt_core.schedule_history[0]["forward"]
                                       for layer in cobalt_layers(engine)],
                   "models": [layer.cobalt_core.schedule_history[0]["model"] for layer in cobalt_layers(engine)],
                   "gate": [h.decisions for h in engine.cobalt_step_hooks if isinstance(h, ScheduleGate)]}
    engine.destroy()
    return out


def test_bare_cobalt_section_replans_with_a_spare_slot_and_matches_deepspeed(run_ranks) -> None:
    import numpy as np

    from ds_cobalt.runtime.layer import SCHEDULE_WARMUP

    for out in run_ranks(_default_body, 4, ranks_per_node=2, timeout=400):
        for name in ("auto", "hierarchical"):
            np.testing.assert_allclose(out[name], out["deepspeed"], rtol=1e-5, atol=1e-6)
            history = out[f"{name}_history"]
            # re-plans after step 12 (planner.first_replan_step), 25 (early_replans: half the interval) and 50,
            # applied 5 steps later; a layer on dense is left out, and when every layer is the re-plan is skipped
            # (its step in dense_skips)
            # (a re-plan due while `auto` still timed a layer's schedules starts once they are chosen: `deferred`)
            started = dict((start, due) for due, start in out[f"{name}_deferred"])
            # (a layer whose cost model expected a gain from a layout: planned after step 1, applied after step 3)
            assert all(h[:2] == (1, 3) for h in history if h[4]) and all(not h[4] for h in history[1:]), history
            history = [h for h in history if not h[4]]
            plans = ((12, 17), (25, 30), (50, 55))
            assert all((started.get(h[0], h[0]), h[1] - h[0] + started.get(h[0], h[0])) in plans
                       and h[2] + len(h[3]) == 2 for h in history), history
            assert sorted([started.get(s, s) for s in [h[0] for h in history] + out[f"{name}_dense_skips"]]) == [
                12, 25, 50]
            for i, (slots, schedule) in enumerate(zip(out[f"{name}_slots"], out[f"{name}_schedules"])):
                if schedule != "dense":  # E / W = 2 owner slots + planner.redundant_slots = 1, filled
                    assert slots.shape == (4, 3) and (slots[:, 2] >= 0).all(), (name, i, slots, history)
        for schedule, (candidates, known), timed_dense, clear, inherited in zip(
                out["auto_kept"], out["auto_next_candidates"], out["auto_timed_dense"], out["auto_clear"],
                out["auto_inherited_model"]):
            if schedule == "dense":
                assert (candidates, known) == (["dense"], {}), (candidates, known)
            elif timed_dense and clear:  # a re-timing against dense's time: no cost model of its own, the last one's
                assert candidates == [schedule] and list(known) == ["dense"], (schedule, candidates, known)
                assert inherited
            else:  # a narrow win (or dense never timed): both timed again, the same layout keeps the model's order
                assert sorted(candidates) == sorted([schedule, "dense"]) and not known, (schedule, candidates, known)
                assert inherited or not timed_dense
        for schedule, decisions in zip(out["auto_kept"], out["auto_decisions"]):
            # every decision, in the order made: the first after the warm-up, on the cost model's predictions for all
            # three candidates (dense without trials where the gate found the model's saving immaterial, else after
            # the trials); the last is the schedule kept
            first, last = decisions[0], decisions[-1]
            if "untimed_saving_share" in first:
                assert (first["forward"], first["schedule"], first["timings_s"]) == (SCHEDULE_WARMUP, "dense", {})
                assert len(decisions) == 1, decisions
            else:
                assert first["forward"] > SCHEDULE_WARMUP + 1, decisions
            assert set(first["model"]["predicted_comm_s"]) == {"hierarchical", "direct", "dense"}, decisions
            assert last["schedule"] == schedule and all(d["schedule"] for d in decisions), decisions
            assert [d["forward"] for d in decisions] == sorted({d["forward"] for d in decisions}), decisions
        # the gate (`auto` only) checked both layers after step 1 (the plan before the trials) and after the warm-up
        # (the trials); it settled them where the history says
        assert out["hierarchical_gate"] == [] and len(out["auto_gate"]) == 1, out["auto_gate"]
        plan, trials = out["auto_gate"][0]
        assert [(g["step"], g["for"], g["layers"]) for g in (plan, trials)] == [(1, "plan", 2),
                                                                                  (SCHEDULE_WARMUP, "trials", 2)]
        assert plan["step_s"] > 0 and trials["step_s"] > 0, (plan, trials)
        assert all(("untimed_saving_share" in d[0]) == (trials["immaterial_share"] is not None)
                   for d in out["auto_decisions"]), (trials, out["auto_decisions"])
        # every forward on some schedule; an immaterial saving after step 1 has dense run the rest of the warm-up
        # (and, kept without trials, every later step): at most the first step ran the model's favourite
        for forwards in out["auto_forwards"]:
            assert sum(forwards.values()) == len(out["deepspeed"]), forwards
            if plan["immaterial_share"] is not None:
                assert forwards.get("dense", 0) >= SCHEDULE_WARMUP - 1, (plan, forwards)
                if trials["immaterial_share"] is not None:
                    assert forwards["dense"] >= len(out["deepspeed"]) - 1, (plan, trials, forwards)
        assert out["hierarchical_next_candidates"] == [(["hierarchical"], {})] * 2
        assert out["hierarchical_deferred"] == []  # one candidate: chosen at once, nothing waits
        early = out["early"]
        np.testing.assert_allclose(out["early_losses"], out["deepspeed"][:16], rtol=1e-5, atol=1e-6)
        # due after step 2 (the trials, a warm-up and three rounds, are not over then); started, or skipped where
        # every layer settled on dense, after the first step at which every layer had chosen
        ready = next(g for g in range(2, len(early["chosen_after"])) if early["chosen_after"][g])
        assert ready > 2 and sorted(early["starts"] + early["dense_skips"])[0] == ready, early
        assert early["deferred"][0] == (2, ready), early
        assert [h[:2] for h in out["hierarchical_history"]] == [(12, 17), (25, 30), (50, 55)]
        assert all(h[3] == [] for h in out["hierarchical_history"])
        slow = out["slow"]
        np.testing.assert_allclose(out["slow_losses"], out["deepspeed"][:20], rtol=1e-5, atol=1e-6)
        assert slow["history"] and slow["history"][0] == (1, 3, 2, True), slow  # both layers, before the trials
        assert all(not h[3] for h in slow["history"][1:]), slow
        # the layout (one spare slot filled at least) arrives before the first timed step: a replica-only change
        # right after step 3, a migration in the next forward's pre-hook (asynchronous); the first decision comes
        # after the trials on it (a warm-up step and three rounds), or at once where the model on the new layout
        # rules out every schedule but dense (its traffic copies' weights, priced on the 0.4 Mbit/s link). A layer whose
        # replica-only change the rows of steps 2-3 do not confirm (its traffic copies, priced the same way, saving
        # less there than their weights cost) keeps its layout
        assert all(changed in (3, 4) or (changed is None and i in slow["unconfirmed"][0])
                   for i, changed in enumerate(slow["changed_at"])), slow
        assert any(changed in (3, 4) for changed in slow["changed_at"]), slow
        for first, model in zip(slow["first_decisions"], slow["models"]):
            if set(model["pruned"]) == {"hierarchical", "direct"}:
                assert first == SCHEDULE_WARMUP + 1, repr(slow)
            else:
                assert first > SCHEDULE_WARMUP + 2, repr(slow)


def _stage2_auto_body(rank: int, world: int) -> dict:
    import slow_policy  # noqa: F401 - registers test_slow_shuffle (random owners, a replica per rank)

    import ds_cobalt
    from ds_cobalt.integrations.layers import layer_cores

    steps = range(24)
    engine = build_engine("deepspeed", 1)
    out = {"deepspeed": train(engine, steps)}
    engine.destroy()
    # one re-plan (after step 12, applied at 13) whose layout has spare slots to refill on node 0's rank 1 and
    # node 1's rank 3 (the replica of the previous rank's expert); then `auto` times step and interval
    cobalt = {"planner": {"replan_interval": 12, "apply_lag": 1, "policy": "test_slow_shuffle"},
              "migration": {"ignore_cost_model": True}, "transport": {"schedule": "hierarchical"}}
    engine = build_engine("cobalt", 1, cobalt=cobalt)
    seen = []
    out["cobalt"] = train(engine, steps, before_step=lambda e, s: seen.append([c.stage2 for c in layer_cores(e)]))
    out["stage2_seen"] = seen
    out["stage2"] = [row["stage2"] for row in ds_cobalt.schedule_summary(engine.module)]
    out["refilled_forwards"] = ds_cobalt.balance_summary(engine.module)["forwards"]
    out["modes"] = [core.replica_modes("hierarchical") for core in layer_cores(engine)]
    out["timed"] = [sorted(core._replica_chooser.medians) for core in layer_cores(engine)]
    engine.destroy()
    # the direct schedule has no stage 2: the re-plan's replicas or none, timed
    engine = build_engine("cobalt", 1, cobalt={**cobalt, "transport": {"schedule": "direct"}})
    out["direct"] = train(engine, steps)
    out["direct_stage2"] = [core.stage2 for core in layer_cores(engine)]
    out["direct_timed"] = [sorted(core._replica_chooser.medians) for core in layer_cores(engine)]
    engine.destroy()
    return out


def test_stage2_auto_times_step_interval_and_no_replicas_and_matches_deepspeed(run_ranks) -> None:
    """`planner.stage2: "auto"` after a layout with replicas: the hierarchical schedule times stage 2 every step, the
    re-plan's replicas and none (the spare slots unused), the direct schedule the last two; exact either way."""
    import numpy as np

    results = run_ranks(_stage2_auto_body, 4, ranks_per_node=2, timeout=400)
    for out in results:
        np.testing.assert_allclose(out["cobalt"], out["deepspeed"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["direct"], out["deepspeed"], rtol=1e-5, atol=1e-6)
        assert all(row == [None, None] for row in out["stage2_seen"][:14])  # contiguous layout: nothing to refill
        assert set(out["stage2"]) <= {"step", "interval", "none"} and None not in out["stage2"]  # decided
        assert out["modes"] == [["step", "interval", "none"]] * 2 and out["timed"] == [["interval", "none", "step"]] * 2
        assert set(out["direct_stage2"]) <= {"interval", "none"} and out["direct_timed"] == [["interval", "none"]] * 2
        assert out["refilled_forwards"] > 0  # the step trials refilled
    assert all(out["stage2"] == results[0]["stage2"] for out in results)  # every rank agrees


def _accumulation_body(rank: int, world: int) -> dict:
    import ds_cobalt
    from ds_cobalt.integrations.schedule_gate import ScheduleGate

    micro_steps = range(24)  # 6 optimizer steps of 4 micro-batches: the warm-up ends within step 1
    accumulate = {"gradient_accumulation_steps": 4}
    engine = build_engine("deepspeed", 1, extra=accumulate)
    out = {"deepspeed": train(engine, micro_steps)}
    engine.destroy()
    engine = build_engine("cobalt", 1, extra=accumulate)  # a bare section: `auto`, the gate, re-planning
    out["cobalt"] = train(engine, micro_steps)
    out["gate"] = [g.decisions for g in engine.cobalt_step_hooks if isinstance(g, ScheduleGate)]
    out["traffic"] = ds_cobalt.traffic_summary(engine)
    engine.destroy()
    return out


def test_auto_with_gradient_accumulation_matches_deepspeed(run_ranks) -> None:
    """A bare section with 4 micro-batches per optimizer step: `auto`'s warm-up (one forward each) is over within
    step 1, so the gate has no warm-up left to hand to dense and goes on; training is DeepSpeed's."""
    import numpy as np

    for out in run_ranks(_accumulation_body, 4, ranks_per_node=2, timeout=300):
        np.testing.assert_allclose(out["cobalt"], out["deepspeed"], rtol=1e-5, atol=1e-6)
        assert len(out["gate"]) == 1 and out["gate"][0][0]["step"] == 1, out["gate"]
        t = out["traffic"]
        assert sum(t[f"forwards_{name}"] for name in ("hierarchical", "direct", "dense")) == 2 * 24, t


def _eval_body(rank: int, world: int) -> dict:
    import itertools

    import torch
    from test_migration import batch

    from ds_cobalt.integrations.layers import layer_cores
    from ds_cobalt.runtime import tile_tuner

    # every timed window lasts 10 s: the trials tie and the cost model's saving is immaterial against such a step,
    # so the choices (dense, settled by the gate after the warm-up) do not depend on this machine's timing
    clock = itertools.count()
    tile_tuner.StepTimedChoice._now = staticmethod(lambda device: 10.0 * next(clock))

    def run(evaluate: bool) -> dict:
        engine = build_engine("cobalt", 1, cobalt={"planner": {"replan_interval": 0}})
        chosen_after: list[bool] = []  # every layer's schedule chosen, after each optimizer step

        def before(e, step: int) -> None:
            if step:
                chosen_after.append(all(core.schedule is not None for core in layer_cores(e)))
            if evaluate:  # an evaluation between training steps: eval mode, no gradients
                e.eval()
                with torch.no_grad():
                    e(*batch(1000 + step, rank))
                e.train()

        losses = train(engine, range(16), before_step=before)
        out = {"losses": losses, "chosen_after": chosen_after,
               "history": [[(h["forward"], h["schedule"]) for h in core.schedule_history]
                           for core in layer_cores(engine)],
               "forwards": [core.forwards for core in layer_cores(engine)],
               "load": [core.stats.load_E.tolist() for core in layer_cores(engine)]}
        engine.destroy()
        return out

    return {"train": run(False), "with_eval": run(True)}


def test_eval_forwards_are_not_trial_steps(run_ranks) -> None:
    """Evaluations between training steps (eval mode, no gradients) run the leading or chosen schedule and time
    nothing: `auto` makes its choices after the same optimizer steps as without them, training is unchanged, and
    the routing statistics count the training forwards only."""
    import numpy as np

    for out in run_ranks(_eval_body, 4, ranks_per_node=2, timeout=300):
        plain, evaluated = out["train"], out["with_eval"]
        np.testing.assert_allclose(evaluated["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
        assert evaluated["forwards"] == [2 * f for f in plain["forwards"]]  # an eval forward before each step
        assert evaluated["chosen_after"] == plain["chosen_after"] and any(plain["chosen_after"]), out
        assert [[s for _, s in h] for h in evaluated["history"]] == [[s for _, s in h] for h in plain["history"]]
        # nor routing statistics (what re-plans, their token counts and traces read): the training steps' alone
        assert evaluated["load"] == plain["load"] and sum(map(sum, plain["load"])) > 0


def _timeline_replanner(layers: list, cfg):
    """A `Replanner` over stand-in layers with no planner, engine or process group: its step timeline alone."""
    from ds_cobalt.config import MigrationConfig
    from ds_cobalt.integrations.replan import Replanner

    hook = Replanner.__new__(Replanner)
    hook.layers, hook.mig, hook.cfg = layers, MigrationConfig(), cfg
    hook._planner, hook._apply_at, hook._mine, hook._deferred_from, hook.stats_since_step = None, None, [], None, 0
    hook._interval, hook._early = cfg.replan_interval, cfg.early_replan_steps
    hook.dense_skips, hook.deferred, hook.history, hook._owners_stay = [], [], [], []
    hook._positions, hook._all_layers = list(range(len(layers))), len(layers)
    return hook


def test_replan_due_during_trials_waits_then_starts_or_is_skipped() -> None:
    """The timeline alone (one process, stand-in layers): a plan step while `auto` still makes a layer's first
    choice waits; it starts once every layer has chosen, or is skipped (and still listed as deferred) where every
    layer settled on dense."""
    import types

    from ds_cobalt.config import PlannerConfig
    from ds_cobalt.integrations.replan import Replanner

    def replanner(layer) -> Replanner:
        hook = _timeline_replanner([layer], PlannerConfig(replan_interval=20, first_replan_step=4, apply_lag=1))
        hook.started = []
        hook._start = lambda engine, step: hook.started.append(step)
        return hook

    for settles_on, started, skipped in (("dense", [], [6]), ("hierarchical", [6], [])):
        layer = types.SimpleNamespace(layout_settled=False, schedule=None, first_schedule_chosen=False,
                                      expects_layout_gain=False, stats=types.SimpleNamespace(reset=lambda: None))
        hook = replanner(layer)
        for step in range(1, 8):
            if step == 6:  # `auto`'s first choice, made during step 6
                layer.schedule, layer.first_schedule_chosen = settles_on, True
                layer.layout_settled = settles_on == "dense"
            hook(types.SimpleNamespace(global_steps=step))
        assert (hook.started, hook.dense_skips, hook.deferred) == (started, skipped, [(4, 6)]), settles_on


@pytest.mark.parametrize("gaps, step_s, share", [
    ([(0.0006, 0.0006), (0.0006, 0.0006)], 0.15, 0.0012 / 0.1512),  # loopback: ~1 % of a step
    ([(0.009, 0.009), (0.008, 0.008)], 0.23, 0.017 / 0.247),  # 7 % of a step
    ([(0.056, 0.056), (0.043, 0.043)], 0.34, None),  # 22 %: the trials run
    ([(-0.004, -0.004), (-0.005, -0.005)], 0.12, 0.0),  # dense the cheapest: no saving
    ([(0.02, -0.01)], 0.19, None),  # the warm-up ran a slower favourite: a dense step is 0.18 s, 11 %
])
def test_immaterial_share_compares_the_saving_with_a_dense_step(gaps, step_s, share) -> None:
    """`immaterial_share`: the model's saving over dense, summed over the layers, as a share of a dense step (the
    warm-up's step corrected by the favourite's predicted gap), when below MATERIAL_SAVING."""
    from ds_cobalt.integrations.schedule_gate import immaterial_share

    assert immaterial_share(gaps, step_s) == (None if share is None else pytest.approx(share))


def test_schedule_gate_checks_the_plan_after_step_one_and_the_trials_after_the_warm_up() -> None:
    """`ScheduleGate` (one process, stand-in layers): after step 1 it marks whether the model's saving is material
    to a step (the plan before the trials) and, where it is not, has dense run the rest of the warm-up; when the
    warm-ups end it settles the layers on dense where the saving is immaterial against their longest warm-up window
    (nothing where it matters); idle after the first choices. A material verdict stands: a warm-up restarted by a
    new layout (one slow step after a migration) is not checked again."""
    import types

    from ds_cobalt.integrations import schedule_gate

    class Layer:
        def __init__(self, gap: float, window_s: float) -> None:
            self.gap, self.warmup_step_s, self.step = gap, window_s, 0
            self.first_schedule_chosen, self.settled, self.layout_gain_material = False, None, True
            self.owner_moves_priced = self.owner_moves_judged = False
            self.groups = types.SimpleNamespace(ep_group=None)
            self.dense_warm_up_from: int | None = None
            self.due_steps = (3,)
            self.dense_ruled_out = False

        def warm_up_on_dense(self) -> None:
            self.dense_warm_up_from = self.step + 1

        @property
        def dense_modelled(self) -> bool:
            return not self.first_schedule_chosen

        @property
        def dense_contested(self) -> bool:
            return not self.first_schedule_chosen and not self.dense_ruled_out

        @property
        def first_trials_due(self) -> bool:
            return self.dense_contested and self.step in self.due_steps

        def predicted_dense_gaps(self) -> tuple[float, float]:
            return self.gap, self.gap

        def settle_dense(self, share: float) -> None:
            self.first_schedule_chosen, self.settled = True, share

    def run(gaps: list[float], windows: list[float], windows_from: dict[int, list[float]] | None = None,
            due_steps: tuple[int, ...] = (3,), ruled_out: tuple[bool, ...] = (False, False), first_step: int = 1,
            ) -> tuple[list[Layer], schedule_gate.ScheduleGate]:
        """`windows_from`: the layers' warm-up windows from a step on; `ruled_out`: the model rules dense out;
        `first_step`: the engine's first step (after a resume: the step after the checkpoint's)."""
        layers = [Layer(gap, window) for gap, window in zip(gaps, windows)]
        for layer, out in zip(layers, ruled_out):
            layer.dense_ruled_out = out
        gate = schedule_gate.ScheduleGate()
        gate._cores = layers
        for step in range(first_step, first_step + 5):
            now = [windows] + [w for first, w in sorted((windows_from or {}).items()) if first <= step]
            for layer, window in zip(layers, now[-1]):
                layer.step, layer.due_steps, layer.warmup_step_s = step, due_steps, window
            gate(types.SimpleNamespace(global_steps=step))
        return layers, gate

    layers, gate = run([0.005, 0.005], [0.25, 0.2])  # 0.01 s against a dense step of 0.25 + 0.01 s
    assert [layer.settled for layer in layers] == [pytest.approx(0.01 / 0.26)] * 2
    assert [layer.layout_gain_material for layer in layers] == [False, False]
    assert [layer.dense_warm_up_from for layer in layers] == [2, 2]
    assert [(d["step"], d["for"], d["layers"], d["step_s"]) for d in gate.decisions] == [
        (1, "plan", 2, 0.25), (3, "trials", 2, 0.25)]
    assert [layer.owner_moves_priced for layer in layers] == [False, False]
    layers, gate = run([0.05, 0.05], [0.25, 0.2])  # 0.1 s of 0.35: the plan and the trials run, owners may move
    assert [layer.settled for layer in layers] == [None, None]
    assert [layer.layout_gain_material for layer in layers] == [True, True]
    assert [layer.owner_moves_priced for layer in layers] == [True, True]
    assert [layer.dense_warm_up_from for layer in layers] == [None, None]
    assert [d["immaterial_share"] for d in gate.decisions] == [None]  # the plan's verdict stands for the trials
    assert [d["saving_share"] for d in gate.decisions] == [pytest.approx(0.1 / 0.35)]
    # material after step 1 (0.1 of 0.35 s); the trials' check would read 0.1 of 1.1 s (the step after a migration)
    layers, gate = run([0.05, 0.05], [0.25, 0.2], windows_from={2: [1.0, 1.0]})
    assert [layer.settled for layer in layers] == [None, None] and len(gate.decisions) == 1
    # no window after step 1 (nothing priced): the trials are checked and cleared (0.1 of 0.35 s); a warm-up
    # restarted by a new layout (due again after step 4, its one step slow) is not checked again
    layers, gate = run([0.05, 0.05], [0.0, 0.0], windows_from={2: [0.25, 0.2], 4: [1.0, 1.0]}, due_steps=(3, 4))
    assert [(d["step"], d["for"]) for d in gate.decisions] == [(1, "plan"), (3, "trials")]
    assert [layer.owner_moves_priced for layer in layers] == [False, False]
    assert [layer.settled for layer in layers] == [None, None]
    # 0.06 s of 0.31 (19 %): material, so the trials run, but below OWNER_MOVE_SHARE: no owner moves before them
    assert schedule_gate.OWNER_MOVE_SHARE == 0.20
    layers, gate = run([0.03, 0.03], [0.25, 0.2])
    assert [layer.settled for layer in layers] == [None, None]
    assert [(layer.owner_moves_judged, layer.owner_moves_priced) for layer in layers] == [(True, False)] * 2
    assert [d["saving_share"] for d in gate.decisions] == [pytest.approx(0.06 / 0.31)]
    # a layer whose model rules dense out is judged for owner moves too, but neither gated nor settled (dense is
    # timed in its trials)
    layers, gate = run([0.03, 0.03], [0.25, 0.2], ruled_out=(True, False))
    assert [(layer.owner_moves_judged, layer.owner_moves_priced) for layer in layers] == [(True, False)] * 2
    assert [(d["for"], d["layers"]) for d in gate.decisions] == [("plan", 2)]
    layers, gate = run([0.005, 0.005], [0.25, 0.2], ruled_out=(True, False))
    assert [layer.settled for layer in layers] == [None, pytest.approx(0.005 / 0.205)]  # its own window and gap
    assert [(d["for"], d["layers"]) for d in gate.decisions] == [("plan", 2), ("trials", 1)]
    # a resumed run (first step 41) whose checkpoint carried no first choice: judged after its own first step
    layers, gate = run([0.03, 0.03], [0.25, 0.2], first_step=41, due_steps=(43,))
    assert [(layer.owner_moves_judged, layer.owner_moves_priced) for layer in layers] == [(True, False)] * 2
    assert [(d["step"], d["for"]) for d in gate.decisions] == [(41, "plan")]


def test_plan_before_trials_starts_after_step_one_for_the_layers_expecting_a_gain() -> None:
    """The timeline alone (one process, stand-in layers): after step 1, while `auto` makes its first choices, the
    layers whose cost model expects a gain from the layout are planned (the others left out), applied before the
    trials start (after step SCHEDULE_WARMUP at the latest); nothing of the kind where no layer expects a gain, where
    `plan_before_trials` is off, or where the first choices are made already."""
    import types

    from ds_cobalt.config import PlannerConfig
    from ds_cobalt.runtime.layer import SCHEDULE_WARMUP

    def run(gains: list[bool], chosen: bool = False, **planner) -> list[tuple]:
        layers = [types.SimpleNamespace(layout_settled=False, schedule="dense" if chosen else None,
                                        first_schedule_chosen=chosen, expects_layout_gain=gain,
                                        stats=types.SimpleNamespace(reset=lambda: None)) for gain in gains]
        hook, started = _timeline_replanner(layers, PlannerConfig(**planner)), []

        def start(engine, step, skipped=None, apply_lag=None):
            started.append((step, skipped, apply_lag))
            hook._apply_at = step + (hook.cfg.effective_apply_lag if apply_lag is None else apply_lag)

        hook._start, hook._apply = start, lambda engine: setattr(hook, "_apply_at", None)
        for step in range(1, 6):
            hook(types.SimpleNamespace(global_steps=step))
        return started

    assert run([True, False]) == [(1, [1], SCHEDULE_WARMUP - 1)]  # applied after step 3, before the trials
    assert run([False, True], apply_lag=1) == [(1, [0], 1)]
    assert run([False, False]) == []
    assert run([True], plan_before_trials=False) == []
    assert run([True], chosen=True) == []  # a fixed schedule, or a resumed run: the usual first re-plan only


def test_replan_apply_confirms_a_migration_on_the_rows_routed_since_its_sample(monkeypatch) -> None:
    """`_apply` in one process, stand-in layer and planner: a planned migration goes ahead where the rows routed
    since the plan's sample favour its layout, and the layer keeps its layout (listed as unconfirmed) where they
    favour the current one; with `confirm_on_newer_routing` off, or no step since the sample, it migrates as
    planned."""
    import types

    import numpy as np
    import torch

    from ds_cobalt.config import PlannerConfig
    from ds_cobalt.integrations import replan as replan_module
    from ds_cobalt.planner import LinkModel
    from ds_cobalt.planner.decisions import MIGRATE, LayerDecision
    from ds_cobalt.runtime.stats import DeviceRoutingStats

    current = np.arange(8).reshape(4, 2)  # rows come from rank 0 (one process): node 0 holds {0..3}
    planned = np.array([[0, 7, 1], [1, 6, 0], [2, 5, 3], [3, 4, 2]])  # node 0 holds {0, 1, 6, 7}; 1 spare slot

    def apply(pairs: list[list[int]], since: int = 10, fallback=None, owners_stay=(), **planner) -> list:
        stats = DeviceRoutingStats(8, 2, sample_tokens=256)
        stats.update(torch.tensor(pairs * (256 // len(pairs))))
        layer = types.SimpleNamespace(stats=stats, layout_slots=current, num_experts=8, num_local_experts=2,
                                      topology=types.SimpleNamespace(world_size=4, ranks_per_node=2))
        hook = _timeline_replanner([layer], PlannerConfig(redundant_slots=1, sample_tokens=256, **planner))
        hook.link, hook._skipped, hook._start_s, hook._submit_error = LinkModel(expert_params=10), [], {}, None
        hook.stats_since_step, hook._pending = since, ("10", [0], [None], [current], [4096.0], {})
        hook._owners_stay = list(owners_stay)
        decision = LayerDecision(MIGRATE, planned, fallback_WS=fallback)
        hook._planner = types.SimpleNamespace(collect=lambda timeout: ({0: decision}, 0.1, None))
        migrated, replicas = [], []
        monkeypatch.setattr(replan_module, "migrate", lambda engine, slots, **kw: migrated.append(slots[0]))
        layer.set_layout = replicas.append
        hook._apply(types.SimpleNamespace(global_steps=15))
        return [hook.history[-1]["unconfirmed"], len(migrated), [r.tolist() for r in replicas]]

    favour_plan, favour_current = [[0, 7], [1, 6]], [[0, 2], [1, 3]]
    assert apply(favour_plan) == [[], 1, []]
    assert apply(favour_current) == [[0], 0, []]
    assert apply(favour_current, confirm_on_newer_routing=False) == [[], 1, []]
    assert apply(favour_current, since=15) == [[], 1, []]  # applied right after its sample: nothing newer
    # the migration's fallback (the owners in place, spare slots chosen) is applied instead where it is no worse on
    # the newer rows, and not where it is worse
    spares = np.concatenate([current, [[2], [0], [6], [4]]], axis=1)  # each a copy of an expert of its own node
    assert apply(favour_current, fallback=spares) == [[0], 0, [spares.tolist()]]
    # ... and not where it adds traffic copies (node 0 holding 4 and 5 of node 1) that the newer rows do not use
    copies = np.concatenate([current, [[4], [5], [6], [7]]], axis=1)
    assert apply(favour_current, fallback=copies) == [[0], 0, []]
    worse = np.concatenate([current[[2, 3, 0, 1]], [[6], [4], [2], [0]]], axis=1)  # node 0 holds {4..7}: worse
    assert apply(favour_current, fallback=worse) == [[0], 0, []]
    # a plan before the trials for a layer that may still run dense: its spare slots only, or nothing without them
    assert apply(favour_plan, fallback=spares, owners_stay=[0]) == [[], 0, [spares.tolist()]]
    assert apply(favour_plan, owners_stay=[0]) == [[], 0, []]


def test_replan_request_prices_tokens_per_step_over_the_steps_its_statistics_sum() -> None:
    """`_start` in one process, stand-in layer and planner: the migration cost model's tokens per step are the
    statistics' tokens over the steps since they were last read (5 steps of 64 tokens here: 64), and the sample is
    the latest `sample_tokens` rows, oldest first."""
    import types

    import numpy as np
    import torch

    from ds_cobalt.config import PlannerConfig
    from ds_cobalt.planner import LinkModel
    from ds_cobalt.runtime.stats import DeviceRoutingStats

    stats = DeviceRoutingStats(8, 2, sample_tokens=256)
    for step in range(11, 16):  # steps 11..15, after the re-plan after step 10
        stats.update(torch.full((64, 2), step % 8))
    topology = types.SimpleNamespace(world_size=4, ranks_per_node=2, nodes=2)
    layer = types.SimpleNamespace(stats=stats, layout_slots=np.arange(8).reshape(4, 2), num_experts=8,
                                  topology=topology, layout_settled=False, owners_may_move=True)
    hook = _timeline_replanner([layer], PlannerConfig(sample_tokens=100))
    hook._mine, hook.stats_since_step, hook.link, requests = [0], 10, LinkModel(), []
    hook._planner = types.SimpleNamespace(submit=lambda *request: requests.append(request))
    hook._start(types.SimpleNamespace(global_steps=15), 15)
    (_, ids, (sample,), _, tokens_per_step, _), = requests
    assert ids == [0] and tokens_per_step == [64.0] and hook.stats_since_step == 15
    assert sample.tokens == 320 and sample.load_E[11 % 8] == 64  # host copies, read before the reset
    np.testing.assert_array_equal(sample.samples_TK[:, 0], [14 % 8] * 36 + [15 % 8] * 64)  # the latest 100 rows


def test_plan_before_trials_restarts_the_trials_of_the_layers_it_leaves_in_step() -> None:
    """`_apply` in one process, stand-in layers and planner: where the plan before the trials gives some layers a
    new layout (which restarts their trials), the layers it leaves as they are restart theirs in the same step;
    not where no layer changes, and not for a later re-plan."""
    import types

    import numpy as np

    from ds_cobalt.config import PlannerConfig
    from ds_cobalt.planner.decisions import KEEP, REPLICAS, LayerDecision

    current = np.arange(8).reshape(4, 2)
    spares = np.concatenate([current, [[4], [5], [6], [7]]], axis=1)

    def apply(actions: list[int], before_trials: bool) -> list[str]:
        events: list[str] = []
        layers = [types.SimpleNamespace(layout_slots=current, num_experts=8, num_local_experts=2,
                                        topology=types.SimpleNamespace(world_size=4, ranks_per_node=2),
                                        set_layout=lambda slots, i=i: events.append(f"layout {i}"),
                                        restart_trials=lambda i=i: events.append(f"restart {i}"))
                  for i in range(len(actions))]
        hook = _timeline_replanner(layers, PlannerConfig(redundant_slots=1, confirm_on_newer_routing=False))
        hook._skipped, hook._submit_error = [], None
        hook._start_s = {"before_trials": True} if before_trials else {}
        hook._pending = ("1", list(range(len(actions))), [None] * len(actions), [current] * len(actions),
                         [64.0] * len(actions), {})
        decisions = {i: LayerDecision(a, spares if a == REPLICAS else current) for i, a in enumerate(actions)}
        hook._planner = types.SimpleNamespace(collect=lambda timeout: (decisions, 0.1, None))
        hook._apply(types.SimpleNamespace(global_steps=3))
        return events

    assert apply([REPLICAS, KEEP, KEEP], before_trials=True) == ["layout 0", "restart 1", "restart 2"]
    assert apply([KEEP, KEEP], before_trials=True) == []
    assert apply([REPLICAS, KEEP], before_trials=False) == ["layout 0"]


def test_owners_stay_unless_dense_is_ruled_out_or_clearly_beaten() -> None:
    """`LayerCore.owners_may_move`, `layout_settled` and the replanner's `_owners_staying`: before the first
    choice, owners move only where `ScheduleGate` priced the saving large against the step (without its verdict: the
    cost model rules dense out); after it, where the kept schedule follows the layout and dense was not measured in
    the last decision, or measured OWNER_MOVE_WIN slower (the measurement wins over the model's ruling), and the
    gate, where it judged the layer, priced it large or the win was DECLINE_OVERRULING_WIN; never held with
    `migration.ignore_cost_model`, and skipped layers are not listed."""

    from ds_cobalt.config import MigrationConfig, PlannerConfig
    from ds_cobalt.runtime.layer import DECLINE_OVERRULING_WIN, OWNER_MOVE_WIN, LayerCore
    from ds_cobalt.runtime.tile_tuner import StepTimedChoice

    def core(pruned=(), history=()):
        layer = LayerCore.__new__(LayerCore)
        layer._chooser = StepTimedChoice(["hierarchical", "direct", "dense"])
        layer._chooser.use_model({"hierarchical": 1.0, "direct": 1.0, "dense": 2.0}, list(pruned))
        layer.schedule_history = [{"forward": 10 * (n + 1), "schedule": s, "timings_s": t, "model": {"pruned": p}}
                                  for n, (s, t, p) in enumerate(history)]
        layer._kept_schedule, layer.owner_moves_priced = (history[-1][0] if history else None), False
        layer.owner_moves_judged = False
        return layer

    assert OWNER_MOVE_WIN == 0.15
    win = 1.0 - OWNER_MOVE_WIN
    assert core(pruned=["dense"]).owners_may_move and not core().owners_may_move  # before the first choice
    priced = core()
    priced.owner_moves_judged = priced.owner_moves_priced = True  # `ScheduleGate`: a saving large against the step
    assert priced.owners_may_move
    declined = core(pruned=["dense"])
    declined.owner_moves_judged = True  # ... and its verdict stands where the model rules dense out
    assert not declined.owners_may_move
    cases = [
        ([("direct", {"direct": 0.5, "dense": 1.0}, [])], True),  # a clear win
        ([("direct", {"direct": win - 0.01, "dense": 1.0}, [])], True),
        ([("direct", {"direct": win + 0.01, "dense": 1.0}, [])], False),  # a narrow one
        ([("hierarchical", {"hierarchical": 0.9}, ["dense"])], True),  # dense ruled out, not measured
        ([("hierarchical", {"hierarchical": 0.9, "dense": 1.0}, ["dense"])], False),  # ruled out, measured close
        ([("hierarchical", {}, [])], True),  # a fixed schedule: dense no candidate
        ([("dense", {"dense": 1.0, "direct": 1.2}, [])], False),
        # the last decision counts: a re-timing that found the win narrow holds the owners
        ([("direct", {"direct": 0.5, "dense": 1.0}, []), ("direct", {"direct": 0.95, "dense": 1.0}, [])], False),
    ]
    for history, expected in cases:
        assert core(history=history).owners_may_move is expected, history
    # re-plans leave out a layer on dense, and one whose first choice is made where the gate priced the saving small
    settled = core(history=cases[1][0])
    assert not settled.layout_settled
    settled.owner_moves_judged = True
    assert settled.layout_settled
    settled.owner_moves_priced = True
    assert not settled.layout_settled
    before = core()
    before.owner_moves_judged = True  # before the first choice: the plan before the trials (`expects_layout_gain`)
    assert not before.layout_settled
    # after the first choice too, a clear trial win moves no owners where `ScheduleGate` priced the saving small
    # against the step; where it priced it large, the measured win decides as above
    for priced_large in (False, True):
        for history, expected in cases[1:3]:
            judged = core(history=history)
            judged.owner_moves_judged, judged.owner_moves_priced = True, priced_large
            assert judged.owners_may_move is (expected and priced_large), history
    # ... unless the win measured DECLINE_OVERRULING_WIN (the measurement wins over the model's price)
    assert DECLINE_OVERRULING_WIN == 0.30
    for ratio, overruled in ((0.69, True), (0.71, False)):
        judged = core(history=[("hierarchical", {"hierarchical": ratio, "dense": 1.0}, [])])
        judged.owner_moves_judged = True
        assert judged.owners_may_move is overruled and judged.layout_settled is not overruled, ratio
    layers = [core(history=h) for h, _ in cases[:3]]
    hook = _timeline_replanner(layers, PlannerConfig())
    assert hook._owners_staying([]) == [2] and hook._owners_staying([2]) == []
    hook.mig = MigrationConfig(ignore_cost_model=True)
    assert hook._owners_staying([]) == []


def test_settled_layers_retime_their_schedule_at_interval_steps_only() -> None:
    """Where every layer is `layout_settled`, the re-plans are skipped; at those that are multiples of the
    interval (not the early ones) the layers not on dense time their kept schedule against dense again
    (`LayerCore.retime_kept`, here a stand-in that records the step), all in the same step."""
    import types

    from ds_cobalt.config import PlannerConfig

    retimed: list[tuple[int, int]] = []
    step_now = {"s": 0}

    def layer(index: int, dense: bool):
        def retime() -> bool:
            if dense:
                return False
            retimed.append((step_now["s"], index))
            return True
        return types.SimpleNamespace(layout_settled=True, settled_dense=dense, retime_kept=retime,
                                     stats=types.SimpleNamespace(reset=lambda: None))

    hook = _timeline_replanner([layer(0, False), layer(1, True), layer(2, False)],
                               PlannerConfig(replan_interval=20, first_replan_step=4, apply_lag=1))
    for step in range(1, 46):
        step_now["s"] = step
        hook(types.SimpleNamespace(global_steps=step))
    assert hook.dense_skips == [4, 5, 10, 20, 40]  # the early plan steps (`early_replan_steps`) and multiples
    assert retimed == [(20, 0), (20, 2), (40, 0), (40, 2)]


def test_retime_kept_restarts_the_choice_on_the_same_layout_only_after_a_choice() -> None:
    """`LayerCore.retime_kept`: a layer that made its first choice and runs a schedule other than dense installs its
    layout again (which restarts the timing of that schedule against dense); not on dense, not before the first
    choice, not while a timing runs."""
    import types

    import numpy as np

    from ds_cobalt.runtime.layer import LayerCore
    from ds_cobalt.runtime.tile_tuner import StepTimedChoice

    def core(kept, chosen):
        layer = LayerCore.__new__(LayerCore)
        layer._kept_schedule = kept
        layer._chooser = StepTimedChoice([chosen] if chosen else ["hierarchical", "dense"])
        layer._placement = types.SimpleNamespace(slots_WS=np.arange(8).reshape(4, 2))
        layer.installed = []
        layer.install_layout = layer.installed.append
        return layer

    for kept, chosen, expected in (("hierarchical", "hierarchical", True), ("direct", "direct", True),
                                   ("dense", "dense", False), (None, None, False), ("hierarchical", None, False)):
        layer = core(kept, chosen)
        assert layer.retime_kept() is expected, (kept, chosen)
        assert len(layer.installed) == int(expected)


def test_decisions_restore_as_saved_only_between_auto_runs() -> None:
    """`LayerCore.decision_state` / `restore_decisions`: a schedule chosen at the save is used again untimed, with the
    gate's verdicts and the histories; where a timing was running, the layer times again on its layout (re-timing the
    kept schedule, or its first trials); nothing is restored where either run pins a schedule; a schedule the layer
    cannot run, or a missing key, is a ValueError naming it. The overlap tuner's choices come back under any
    schedule, where the overlap settings are the saving run's."""
    import io
    import types

    import numpy as np
    import torch

    from ds_cobalt.runtime.layer import LayerCore
    from ds_cobalt.runtime.tile_tuner import OverlapTuner, StepTimedChoice

    def core(schedule="auto", tile_rows="auto"):
        layer = LayerCore.__new__(LayerCore)
        overlap = types.SimpleNamespace(enabled="auto", tile_rows=tile_rows, rail_chunks="auto")
        layer.settings = types.SimpleNamespace(transport=types.SimpleNamespace(schedule=schedule), overlap=overlap)
        layer.tuner = OverlapTuner()
        layer._chooser = StepTimedChoice(["hierarchical", "direct", "dense"])
        layer._chooser.use_model({"hierarchical": 1.0, "direct": 1.5, "dense": 2.0}, [])
        layer._replica_chooser, layer._replica_schedule = StepTimedChoice(["step"]), "hierarchical"
        layer._schedule_candidates = lambda: ["hierarchical", "direct", "dense"]
        layer._kept_schedule = layer._dense_seconds = None
        layer._dense_ruled_out, layer.layout_gain_material = False, True
        layer.owner_moves_judged = layer.owner_moves_priced = False
        layer.schedule_history, layer.replica_history, layer.forwards = [], [], 0
        layer._placement = types.SimpleNamespace(slots_WS=np.arange(8).reshape(4, 2))
        layer.installed = []
        layer.install_layout = layer.installed.append
        return layer

    saved = core()
    saved._chooser = StepTimedChoice(["direct"])
    saved._chooser.predicted, saved._chooser.pruned = {"direct": np.float64(1.5), "dense": 2.0}, ["dense"]
    saved._chooser.medians = {"direct": 0.2, "dense": 0.3}
    saved._kept_schedule, saved._dense_seconds, saved._dense_ruled_out = "direct", 0.3, True
    saved.owner_moves_judged = saved.owner_moves_priced = True
    saved.tuner.tiles.chosen, saved.tuner.chunks.chosen, saved.tuner.mode.chosen = 128, np.int64(4), 0
    saved.schedule_history = [{"forward": 12, "schedule": "direct", "timings_s": {"direct": 0.2, "dense": 0.3},
                               "model": {"predicted_comm_s": {"direct": 1.5, "dense": 2.0}, "pruned": ["dense"]}}]
    state = saved.decision_state()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state  # plain values: no numpy scalar in a checkpoint
    resumed = core()
    assert resumed.restore_decisions(state) and not resumed.installed
    assert resumed.decision_state() == state and resumed.schedule == "direct"
    assert resumed.owners_may_move and resumed.traffic_bound and resumed._replica_chooser is None
    for timing in ({"schedule": None}, {"schedule": None, "kept": None}):  # a re-timing, the first trials
        resumed = core()
        assert resumed.restore_decisions({**state, **timing}) and resumed.installed == [resumed.layout_slots]
        assert resumed._kept_schedule == timing.get("kept", "direct")
    pinned = core("hierarchical")
    assert not pinned.restore_decisions(state) and pinned.owner_moves_judged is False
    assert not core().restore_decisions({**state, "transport_schedule": "direct"})
    with pytest.raises(ValueError, match="schedule 'overlapped'"):
        core().restore_decisions({**state, "schedule": "overlapped"})
    with pytest.raises(ValueError, match="missing \\['replica_history'\\]"):
        core().restore_decisions({k: v for k, v in state.items() if k != "replica_history"})
    # the overlap tuner's choices: under a pinned schedule too; not for other overlap settings; a checkpoint from
    # before they were saved restores the rest; a choice the tuner cannot make is an error
    assert state["overlap"]["chosen"] == {"tile_rows": 128, "rail_chunks": 4, "overlap": 0}
    assert pinned.tuner.chosen() == state["overlap"]["chosen"]
    other = core(tile_rows=64)
    assert other.restore_decisions(state) and other.schedule == "direct"
    assert other.tuner.chosen() == {"tile_rows": None, "rail_chunks": None, "overlap": None}
    old = core()
    assert old.restore_decisions({k: v for k, v in state.items() if k != "overlap"}) and old.schedule == "direct"
    assert old.tuner.chosen()["tile_rows"] is None
    with pytest.raises(ValueError, match="overlap rail_chunks 3"):
        core().restore_decisions({**state, "overlap": {**state["overlap"], "chosen": {"rail_chunks": 3}}})


def test_left_out_layers_retime_with_an_interval_replan_applied_beside_them() -> None:
    """Where a re-plan after a multiple of the interval plans some layers and leaves others out (`layout_settled`),
    its apply has the left-out ones time their kept schedule against dense again, in the step the planned layers
    take their new layouts; not after an early plan step."""
    import types

    import numpy as np

    from ds_cobalt.config import PlannerConfig

    def layer(index: int, calls: list):
        def retime() -> bool:
            calls.append(index)
            return True
        return types.SimpleNamespace(retime_kept=retime, num_experts=8, num_local_experts=2,
                                     topology=types.SimpleNamespace(world_size=4),
                                     layout_slots=np.arange(8).reshape(4, 2))

    for planned_after, expected in ((20, [1]), (10, [])):
        calls: list[int] = []
        cfg = PlannerConfig(replan_interval=20, first_replan_step=4, apply_lag=1, redundant_slots=0,
                            confirm_on_newer_routing=False)
        hook = _timeline_replanner([layer(0, calls), layer(1, calls)], cfg)
        hook._pending, hook._submit_error, hook._skipped = None, None, [1]
        hook._start_s = {"planned_after_step": planned_after, "before_trials": False}
        hook._apply(types.SimpleNamespace(global_steps=planned_after + 5))
        assert calls == expected, planned_after


def _trace_window_body(rank: int, world: int, out_dir: str) -> dict:
    import logging

    from deepspeed.utils import logger

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        inside = build_engine("cobalt", 0, ep_size=2, cobalt={
            "topology": {"ranks_per_node": 1}, "planner": {"replan_interval": 0},
            "trace": {"path": f"{out_dir}/inside.npz", "start_step": 1, "steps": 20}})
        train(inside, range(3))
        inside.destroy()  # steps 1 and 2 of [1, 21)
        inside.save_cobalt_trace()  # written once
        before = build_engine("cobalt", 0, ep_size=2, cobalt={
            "topology": {"ranks_per_node": 1}, "planner": {"replan_interval": 0},
            "trace": {"path": f"{out_dir}/before.npz", "start_step": 50}})
        train(before, range(2))
        before.save_cobalt_trace()
        jumped = build_engine("cobalt", 0, ep_size=2, cobalt={
            "topology": {"ranks_per_node": 1}, "planner": {"replan_interval": 0},
            "trace": {"path": f"{out_dir}/jumped.npz", "steps": 20}})
        train(jumped, range(2))
        jumped.global_steps = 10  # as a checkpoint load sets it: the rows so far do not lead up to step 10
        train(jumped, range(2))  # steps 11 and 12: recording restarts after step 11, inside the window
        jumped.destroy()
    finally:
        logger.removeHandler(handler)
    return {"messages": messages}


def test_a_run_ending_inside_the_trace_window_writes_what_it_recorded(run_ranks, tmp_path) -> None:
    """`cobalt.trace` writes after its last step; a run that ends inside the window used to lose the steps it
    recorded without a word. `destroy` (and `save_cobalt_trace`, the HF callback's train end) writes them and
    says so; a run that ends before `trace.start_step` is told that nothing was recorded."""
    from ds_cobalt.planner.trace import load_trace

    results = run_ranks(_trace_window_body, 2, str(tmp_path), ranks_per_node=1, timeout=300)
    trace = load_trace(tmp_path / "inside.npz")
    assert trace.experts_LTK.shape[:2] == (2, 2 * 2 * MICRO)  # 2 layers, 2 steps x 2 ranks x a micro-batch
    assert not (tmp_path / "before.npz").exists()
    first = results[0]["messages"]
    assert sum("wrote the routing of steps [1, 3) of [1, 21)" in m for m in first) == 1, first
    assert any("recorded nothing" in m and "trace.start_step=50" in m for m in first), first
    assert results[1]["messages"] == []  # rank 0 reports
    assert load_trace(tmp_path / "jumped.npz").experts_LTK.shape[:2] == (2, 1 * 2 * MICRO)
    assert any("wrote the routing of steps [11, 12) of [0, 20)" in m for m in first), first


def _export_body(rank: int, world: int, out_dir: str) -> dict:
    import numpy as np
    import torch

    import ds_cobalt
    from ds_cobalt.integrations.migration import migrate

    engine = build_engine("cobalt", 0, cobalt={"planner": {"replan_interval": 0}})
    assert engine.cobalt_migrations == []  # there before the first migration
    train(engine, range(2))
    assert migrate(engine, [random_owner_layout(np.random.default_rng(11)) for _ in range(2)]).ok
    out = {"moved": len(engine.cobalt_migrations)}
    engine.save_16bit_model(out_dir, "model16.bin")
    with ds_cobalt.logical_order(engine):
        logical = {k: v.clone() for k, v in engine.module.state_dict().items() if "deepspeed_experts" in k}
    if rank == 0:
        saved = torch.load(f"{out_dir}/model16.bin", map_location="cpu", weights_only=True)
        experts = {k: v for k, v in saved.items() if "deepspeed_experts" in k}
        out["experts"] = len(experts)
        out["same"] = all(torch.equal(v, logical[k]) for k, v in experts.items())
    # inside a gradient-accumulation window the accumulated gradients would stay with the old owners
    accumulating = build_engine("cobalt", 0, extra={"gradient_accumulation_steps": 2},
                                cobalt={"planner": {"replan_interval": 0}})
    train(accumulating, range(1))  # micro-step 0 of 2
    try:
        migrate(accumulating, [random_owner_layout(np.random.default_rng(12)) for _ in range(2)])
    except ValueError as err:
        out["mid_window"] = str(err)
    # the HF Trainer's (accelerate's) loop: the boundary set by hand and `step` once per optimizer step; migrate
    # runs after every optimizer step (it refused every other one: `micro_steps` counts optimizer steps there)
    import torch.distributed as dist
    from test_migration import batch

    managed = build_engine("cobalt", 0, extra={"gradient_accumulation_steps": 2},
                           cobalt={"planner": {"replan_interval": 0}})
    out["accelerate_loop"] = []
    for step in range(3):
        for micro in range(2):
            managed.set_gradient_accumulation_boundary(micro == 1)
            managed.backward(managed(*batch(2 * step + micro, dist.get_rank(), "fp32")))
        managed.step()
        report = migrate(managed, [random_owner_layout(np.random.default_rng(20 + step)) for _ in range(2)])
        out["accelerate_loop"].append(report.ok)
    # managed_gradient_accumulation=false: every `step` is the caller's boundary (migrate then runs, the hooks too)
    unmanaged = build_engine("cobalt", 1, extra={"managed_gradient_accumulation": False},
                             cobalt={"planner": {"replan_interval": 0}})
    train(unmanaged, range(2))
    out["unmanaged"] = migrate(unmanaged, [random_owner_layout(np.random.default_rng(30)) for _ in range(2)]).ok
    # a torch-style `loss.backward()` (ZeRO-1) opens the window as `engine.backward` does
    torch_style = build_engine("cobalt", 1, extra={"gradient_accumulation_steps": 2},
                               cobalt={"planner": {"replan_interval": 0}})
    (torch_style(*batch(0, dist.get_rank(), "fp32")) / 2).backward()
    torch_style.step()  # micro-step 0 of 2
    try:
        migrate(torch_style, [random_owner_layout(np.random.default_rng(31)) for _ in range(2)])
    except ValueError as err:
        out["torch_style_mid_window"] = str(err)
    return out


def test_save_16bit_model_after_migrations_and_migrate_mid_accumulation(run_ranks, tmp_path) -> None:
    """`save_16bit_model` after a migration writes each expert under its own DeepSpeed name (it wrote rank 0's
    current slots, other experts, under them); `migrate` inside a gradient-accumulation window is an error (it
    changed training silently)."""
    results = run_ranks(_export_body, 4, str(tmp_path), ranks_per_node=2, timeout=300)
    assert all(r["moved"] == 1 for r in results)
    assert results[0]["experts"] > 0 and results[0]["same"]
    assert all("inside a gradient-accumulation window (gradient_accumulation_steps=2: a backward ran"
               in r["mid_window"] for r in results)
    assert all(r["accelerate_loop"] == [True, True, True] and r["unmanaged"] for r in results)
    assert all("inside a gradient-accumulation window" in r["torch_style_mid_window"] for r in results)


def test_trace_path_is_checked_at_start_and_a_failed_write_does_not_stop_training(tmp_path, monkeypatch) -> None:
    """`cobalt.trace.path` that rank 0 cannot write fails when the engine is made, naming the key (it failed at the
    end of the trace window and took the job down); a write that fails later (a full disk) is logged and training
    goes on."""
    import torch

    from ds_cobalt.integrations import trace

    engine = torch.nn.Module()  # rank 0, no ds_cobalt layer: the recorder's own behaviour
    engine.global_rank, engine.global_steps = 0, 0
    (tmp_path / "a_file").write_text("x")
    for bad in (tmp_path / "a_file" / "t.npz", tmp_path):
        with pytest.raises(ValueError, match=r"cobalt\.trace\.path"):
            trace.TraceRecorder(engine, bad, first=1, steps=2)
    recorder = trace.TraceRecorder(engine, tmp_path / "new" / "t.npz", first=1, steps=2)  # missing dirs are made

    def full_disk(model, path) -> None:
        raise OSError(28, f"could not write {path}: No space left on device")

    monkeypatch.setattr(trace, "save_trace", full_disk)
    recorder._write(engine, "written")  # logged, not raised
    assert recorder.done
