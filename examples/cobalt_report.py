"""What ds_cobalt did in a run of examples/train_moe.py: per-step cross-node bytes next to DeepSpeed's, per-GPU
expert load, re-plans and migrations; printed at the end of the example's report and saved as a plot.

`StepTracker.after_step()` reads this rank's cumulative counters (`ds_cobalt.traffic_summary`) after each
optimizer step, and the layout whenever it changed (`layouts`: layout-v1 dicts with the first step they served,
which `ds-cobalt calibrate --compare` prices); `gather()` (collective) turns the counters into per-step totals over
the ranks.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

SCHEDULE_KEYS = ("forwards_hierarchical", "forwards_direct", "forwards_dense")
KEYS = ("inter_node_bytes", "deepspeed_inter_node_bytes_padded", "expert_rows", *SCHEDULE_KEYS)


class StepTracker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._last = [0] * len(KEYS)
        self.per_step: list[list[int]] = []  # this rank's KEYS per step
        self.layouts: list[dict] = []  # {"from_step": i (0-based), "layout": layout-v1 dict}, one per change
        self._slots: list[np.ndarray] = []
        self._cores: list | None = None  # the model's layer cores, found once (a module walk per forward costs ~1 %)
        # read after each forward: a migration commits right before a layer's forward
        model.register_forward_hook(lambda *_: self._record_layout())

    def after_step(self) -> None:
        import ds_cobalt

        totals = ds_cobalt.traffic_summary(self.model)
        now = [int(totals[k]) for k in KEYS]
        self.per_step.append([a - b for a, b in zip(now, self._last)])
        self._last = now

    def _record_layout(self) -> None:
        """Append the layers' layout if it changed since the last forward."""
        from ds_cobalt.integrations.layers import layer_cores
        from ds_cobalt.planner.layout import Layout

        if self._cores is None:
            self._cores = layer_cores(self.model)
        cores = self._cores
        slots = [core.layout_slots for core in cores]
        if not cores or (len(slots) == len(self._slots) and all(map(np.array_equal, slots, self._slots))):
            return
        self._slots = [s.copy() for s in slots]
        S = max(s.shape[1] for s in slots)
        padded = np.stack([np.pad(s, ((0, 0), (0, S - s.shape[1])), constant_values=-1) for s in slots])
        topo = cores[0].topology
        layout = Layout(cores[0].num_experts, topo.nodes, topo.ranks_per_node, padded)
        self.layouts.append({"from_step": len(self.per_step), "layout": layout.to_json_dict()})

    def gather(self) -> dict[str, list[float]]:
        """Collective: cross-node bytes per step (sum over ranks), DeepSpeed's padded bytes for the same forwards,
        the per-GPU expert load max/mean of each step (rows computed, replicas included), and the layer forwards
        run on each transport schedule per step (`forwards_<schedule>`, sum over ranks)."""
        from ds_cobalt.runtime.comm import all_reduce_host, collective_device  # NCCL moves no host tensors

        mine = torch.tensor(self.per_step, dtype=torch.float64, device=collective_device()).reshape(-1, len(KEYS))
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        stacked = torch.stack(every).cpu()  # [ranks, steps, keys]
        rows = stacked[:, :, 2]
        mean = rows.mean(0).clamp(min=1e-9)
        import ds_cobalt

        balance = ds_cobalt.balance_summary(self.model)
        stage2 = all_reduce_host(torch.tensor([balance["forwards"], balance["stage2_sum"], balance["interval_sum"]],
                                              dtype=torch.float64))
        forwards = {key: stacked[:, :, KEYS.index(key)].sum(0).tolist() for key in SCHEDULE_KEYS}
        return {"sent": stacked[:, :, 0].sum(0).tolist(), "deepspeed_padded": stacked[:, :, 1].sum(0).tolist(),
                "load_max_over_mean": (rows.max(0).values / mean).tolist(), "stage2": stage2.tolist(), **forwards}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(per_step: dict[str, list[float]], engine: Any) -> dict[str, Any]:
    """Before / after the first re-plan that moved experts (or changed replicas), from the gathered per-step data."""
    from ds_cobalt.integrations.replan import Replanner
    from ds_cobalt.integrations.schedule_gate import ScheduleGate

    hooks = getattr(engine, "cobalt_step_hooks", [])
    replanner = next((h for h in hooks if isinstance(h, Replanner)), None)
    gate = next((h for h in hooks if isinstance(h, ScheduleGate)), None)
    history = replanner.history if replanner is not None else []
    moves = [m for m in getattr(engine, "cobalt_migrations", []) if m.reason.startswith("replan")]
    committed = [m for m in moves if m.ok]
    first = committed[0].step if committed else None
    # step i of the lists is optimizer step i + 1; a migration decided after step s serves from step s + 1 on
    split = first if first is not None else len(per_step["sent"])
    before, after = slice(1, split), slice(split, None)  # step 1 (lazy init, `auto`'s first trial) left out
    out = {"replans": [h.get("planned_after_step", h["step"]) for h in history],
           "replans_before_trials": [h["planned_after_step"] for h in history if h.get("before_trials")],
           # (the plan before `auto`'s trials leaves out the layers whose cost model expects no gain, not dense ones)
           "replan_dense_skipped": sum(len(h["dense_skipped"]) for h in history if not h.get("before_trials")),
           "replan_layers": sum(h["layers"] for h in history if not h.get("before_trials")),
           "replans_skipped_dense": list(replanner.dense_skips) if replanner is not None else [],
           "replan_slowest_share_s": [h["slowest_share_s"] for h in history],
           # (apply step, layers): plans not confirmed on the routing since their sample
           # (planner.confirm_on_newer_routing)
           "replans_unconfirmed": [[h["step"], h["unconfirmed"]] for h in history if h.get("unconfirmed")],
           "replans_owners_held": [[h["step"], h["owners_held"]] for h in history if h.get("owners_held")],
           "migrations": len(committed), "migrations_failed": len(moves) - len(committed),
           "experts_moved": sum(len(m.moved) for m in committed), "migration_steps": [m.step for m in committed],
           "first_migration_step": first,
           # `auto`'s gate: per check (after step 1, before the first trials), the model's saving over dense as a
           # share of a dense step
           "schedule_gate": list(gate.decisions) if gate is not None else []}
    # layer forwards run on each transport schedule, summed over steps and ranks (`auto`'s warm-up and trials included)
    out["forwards_by_schedule"] = {key.removeprefix("forwards_"): int(sum(per_step.get(key, [])))
                                   for key in SCHEDULE_KEYS}
    forwards, refilled, interval = per_step.get("stage2", (0, 0.0, 0.0))
    out["stage2_forwards"] = int(forwards)  # layer forwards refilled, summed over ranks
    out["stage2_node_gpu_max_over_mean"] = refilled / forwards if forwards else None
    out["interval_node_gpu_max_over_mean"] = interval / forwards if forwards else None
    import ds_cobalt

    model = getattr(engine, "module", engine)
    out["stage2_now"] = [row["stage2"] for row in ds_cobalt.schedule_summary(model)]  # per layer, this layout
    for name, window in (("before", before), ("after", after)):
        out[f"sent_per_step_{name}"] = _mean(per_step["sent"][window])
        out[f"deepspeed_padded_per_step_{name}"] = _mean(per_step["deepspeed_padded"][window])
        out[f"load_max_over_mean_{name}"] = _mean(per_step["load_max_over_mean"][window])
    return out


def _percent(share: float) -> str:
    return "<1 %" if 0 < share < 0.005 else f"{100 * share:.0f} %"


def print_summary(s: dict[str, Any], fmt_bytes: Any, plot: str | None) -> None:
    print("what ds_cobalt did")
    ran = {name: n for name, n in s.get("forwards_by_schedule", {}).items() if n}
    if ran:
        total = sum(ran.values())
        shares = ", ".join(f"{name} {_percent(n / total)}" for name, n in sorted(ran.items(), key=lambda kv: -kv[1]))
        print(f"  schedules run       {shares} of the {total} layer forwards (all ranks; `auto`'s trials included)")
    if not s["replans"] and s.get("replans_skipped_dense"):
        print(f"  re-plans            skipped after steps {', '.join(map(str, s['replans_skipped_dense']))}: every "
              "layer runs DeepSpeed's dense exchange (fastest on this link), whose traffic no layout changes, or "
              "one whose saving over it is small against the step")
    elif not s["replans"]:
        print("  re-plans            none (planner.replan_interval = 0, or the run ended before the first)")
    else:
        before = set(s.get("replans_before_trials", []))
        steps = ", ".join(f"{g} (before `auto`'s schedule trials)" if g in before else str(g) for g in s["replans"])
        print(f"  re-plans            after steps {steps} (worker processes; slowest "
              f"rank's share {max(s['replan_slowest_share_s']):.2f} s)")
        if s["replan_dense_skipped"]:
            print(f"                      {s['replan_dense_skipped']} of {s['replan_layers']} layer plans left out: "
                  "those layers run DeepSpeed's dense exchange (fastest on this link), whose traffic no layout "
                  "changes, or save little over it against the step")
    if s.get("replans_unconfirmed"):
        held = "; ".join(f"after step {step}: layer{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
                         for step, ids in s["replans_unconfirmed"])
        print(f"                      not applied ({held}): the routing since their sample no longer favoured them")
    if s.get("replans_owners_held"):
        held = "; ".join(f"after step {step}: layer{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
                         for step, ids in s["replans_owners_held"])
        print(f"                      spare slots only, owners kept ({held}): before the schedule trials, dense may "
              "still win, which no layout helps")
    when = f", after steps {', '.join(map(str, s['migration_steps']))}" if s["migration_steps"] else ""
    failed = f", {s['migrations_failed']} failed" if s["migrations_failed"] else ""
    print(f"  migrations          {s['migrations']} committed ({s['experts_moved']} expert moves{when}){failed}")

    def b(key: str) -> str:
        return fmt_bytes(s[key] or 0)

    if s["sent_per_step_before"] is None and s["first_migration_step"] is None:
        print("  cross-node / step   no step to average: step 1 (lazy init, `auto`'s first trial) is left out")
    elif s["first_migration_step"] is None:
        print(f"  cross-node / step   {b('sent_per_step_before')} (DeepSpeed {b('deepspeed_padded_per_step_before')})"
              "; no migration to compare with")
        print(f"  GPU load max/mean   {s['load_max_over_mean_before'] or 0:.3f}")
    else:
        print(f"  cross-node / step   before the first migration {b('sent_per_step_before')}, after "
              f"{b('sent_per_step_after')} (DeepSpeed: {b('deepspeed_padded_per_step_before')}, "
              f"{b('deepspeed_padded_per_step_after')})")
        print(f"  GPU load max/mean   before {s['load_max_over_mean_before'] or 0:.3f}, after "
              f"{s['load_max_over_mean_after'] or 0:.3f}")
    if s.get("stage2_forwards"):
        print(f"  stage 2 every step  spare slots refilled in {s['stage2_forwards']} layer forwards (all ranks); GPU "
              f"load max/mean inside a node {s['stage2_node_gpu_max_over_mean']:.3f}, with the re-plan's replicas "
              f"only {s['interval_node_gpu_max_over_mean']:.3f} (mean over those forwards); per layer now: "
              f"{', '.join('still timing' if m is None else str(m) for m in s['stage2_now'])} "
              "(`planner.stage2` auto times step, interval and none)")
    else:
        print("  stage 2 every step  not run: no spare slot to refill (before the first re-plan, or the layers ran "
              "the direct or dense schedule)")
    if plot:
        print(f"  plot                {plot}")


def save_plot(per_step: dict[str, list[float]], s: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(per_step["sent"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [b / 2**20 for b in per_step["deepspeed_padded"]], label="DeepSpeed all-to-all (padded E x C)")
    top.plot(steps, [b / 2**20 for b in per_step["sent"]], label="ds_cobalt")
    top.set_ylabel("cross-node MiB / step")
    top.legend(loc="center right")
    bottom.plot(steps, per_step["load_max_over_mean"], color="tab:green")
    bottom.axhline(1.0, color="grey", lw=0.5)
    bottom.set_ylabel("GPU expert load max / mean")
    bottom.set_xlabel("optimizer step")
    for ax in (top, bottom):
        for i, step in enumerate(s["migration_steps"]):
            ax.axvline(step, color="tab:red", ls="--", lw=0.8, label="migration" if ax is top and i == 0 else None)
    if s["migration_steps"]:
        top.legend(loc="center right")
    fig.suptitle("ds_cobalt: cross-node traffic and load per step")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
