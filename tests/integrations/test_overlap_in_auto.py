"""`overlap.enabled` with `transport.schedule: "auto"` (the default schedule): the hierarchical candidate runs
overlapped, dense and direct stay candidates, and the overlap tuner starts timing its settings (tile rows, rail
chunks, overlapped or phased) only once the layer keeps hierarchical; the spare slots' modes are timed after that
(the overlapped schedule has none). Before, overlap on made `auto` mean
hierarchical alone, so a layer could not fall back to DeepSpeed's exchange where that trains faster.
4 gloo CPU ranks as 2 nodes x 2, the model of tests/integrations/test_migration.py, `ds_cobalt.MoE` layers under
`deepspeed.initialize` (no schedule gate: every layer times its candidates).
"""

from __future__ import annotations

STEPS = 40
OVERLAP_AUTO = {"planner": {"replan_interval": 0},
                "overlap": {"enabled": "auto", "tile_rows": "auto", "rail_chunks": "auto"}}


def _run(impl: str, fastest: str | None) -> dict:
    import numpy as np
    from test_migration import build_engine, train

    import ds_cobalt
    from ds_cobalt.integrations.layers import layer_cores
    from ds_cobalt.runtime import tile_tuner

    if fastest is not None:  # every trial step of `fastest` lasts 1 s, of the others 10 s: the choice is `fastest`
        close = tile_tuner.StepTimedChoice._close

        def timed_close(self, now: float) -> None:
            self._started = now - (1.0 if self.trials[self._trial] == fastest else 10.0)
            close(self, now)

        tile_tuner.StepTimedChoice._close = timed_close
    engine = build_engine(impl, 1, cobalt=OVERLAP_AUTO if impl == "cobalt" else None, plain_initialize=True)
    for core in layer_cores(engine) if impl == "cobalt" else ():
        # one spare slot per rank, empty: `planner.stage2: "auto"` times stage 2 every step against no replicas
        core.set_layout(np.concatenate([core.layout_slots, np.full((core.layout_slots.shape[0], 1), -1)], axis=1))
    # per step, per layer: (schedule, tile trials so far, overlap choices, replica-mode decisions so far)
    per_step: list[list[tuple]] = []

    def before(e, step: int) -> None:
        if step and impl == "cobalt":
            per_step.append([(core.schedule, core.tuner.tiles.calls, core.tuner.chosen(), len(core.replica_history))
                             for core in layer_cores(e)])

    out = {"losses": train(engine, range(STEPS), before_step=before), "per_step": per_step}
    if impl == "cobalt":
        cores = layer_cores(engine)
        out |= {"history": [[(h["schedule"], sorted(h["timings_s"])) for h in c.schedule_history] for c in cores],
                "schedule_forwards": [dict(c.schedule_forwards) for c in cores],
                "summary": [layer["overlap"] for layer in ds_cobalt.schedule_summary(engine)]}
        tile_tuner.StepTimedChoice._close = close
    engine.destroy()
    return out


def _body(rank: int, world: int) -> dict:
    return {"hierarchical": _run("cobalt", "hierarchical"), "dense": _run("cobalt", "dense"),
            "deepspeed": _run("deepspeed", None)}


def test_overlap_joins_auto_and_tunes_once_hierarchical_is_kept(run_ranks) -> None:
    import numpy as np

    for out in run_ranks(_body, 4, ranks_per_node=2, timeout=300):
        for fastest in ("hierarchical", "dense"):
            run = out[fastest]
            np.testing.assert_allclose(run["losses"], out["deepspeed"]["losses"], rtol=1e-5, atol=1e-6)
            for history in run["history"]:
                # dense was timed beside the overlapped hierarchical schedule, and the faster one kept
                assert history[0][0] == fastest and {"dense", "hierarchical"} <= set(history[0][1]), history
            for layers in run["per_step"]:
                for schedule, tile_trials, chosen, replica_decisions in layers:
                    if schedule != "hierarchical":  # trials of the schedule, or dense kept: the tuner times nothing
                        assert tile_trials == 0 and set(chosen.values()) == {None}, (fastest, run["per_step"])
                    if chosen["overlap"] is None:  # nor are the spare slots' modes timed before the tuner's choice
                        assert replica_decisions == 0, (fastest, run["per_step"])
        last = out["hierarchical"]["per_step"][-1]
        assert all(None not in chosen.values() for _, _, chosen, _ in last), last
        # phased kept: stage 2 every step and no replicas were timed after it; overlapped kept: nothing to time
        assert all(decisions == (chosen["overlap"] == 0) for _, _, chosen, decisions in last), last
        # `ds_cobalt.schedule_summary` shows what the hierarchical schedule runs with (None: not chosen yet)
        assert out["hierarchical"]["summary"] == [
            {"overlapped": bool(chosen["overlap"]), "tile_rows": chosen["tile_rows"],
             "rail_chunks": chosen["rail_chunks"]} for _, _, chosen, _ in last]
        assert out["dense"]["summary"] == [{"overlapped": None, "tile_rows": None, "rail_chunks": None}] * 2
        assert all("hierarchical" in f and "dense" in f for f in out["dense"]["schedule_forwards"])
