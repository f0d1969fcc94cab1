"""Finding ds_cobalt layers in a model, and what every layer class exposes of its `LayerCore`.

A module is a ds_cobalt layer when it holds a `LayerCore` as `cobalt_core` (`ds_cobalt.MoE`, converted AutoEP
layers, and any future class): discovery needs no registry. Everything below `engine.py` in integrations
finds layers here and talks to their cores.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..runtime.layer import LayerCore
from ..runtime.stats import DeviceRoutingStats
from ..runtime.tile_tuner import OverlapTuner
from ..runtime.topology import Topology
from ..runtime.traffic import TrafficCounters, sum_totals

__all__ = ["CoreAccess", "balance_summary", "cobalt_layers", "layer_cores", "schedule_summary", "traffic_summary"]


def _core(module: torch.nn.Module) -> LayerCore | None:
    core = module.__dict__.get("cobalt_core")
    return core if isinstance(core, LayerCore) else None


def cobalt_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ds_cobalt MoE layers of a model (or of a DeepSpeed engine's module), in module order."""
    module = getattr(model, "module", model)
    return [m for m in module.modules() if _core(m) is not None]


def layer_cores(model: torch.nn.Module) -> list[LayerCore]:
    """The `LayerCore` of every ds_cobalt layer of a model (or engine), in module order."""
    module = getattr(model, "module", model)
    return [core for core in map(_core, module.modules()) if core is not None]


def job_group(cores: Sequence[LayerCore]) -> dist.ProcessGroup | None:
    """ds_cobalt's copy of the world group (`EPGroups.world_group`: its timeout) from the first attached layer;
    None (the default group) where there is none."""
    return next((core.groups.world_group for core in cores if core.attached), None)


SCHEDULES = ("hierarchical", "direct", "dense")


def traffic_summary(model: torch.nn.Module) -> dict[str, int]:
    """Cumulative traffic of this rank over all ds_cobalt layers: bytes/rows sent inter- and intra-node,
    and what DeepSpeed's all-to-all would have sent inter-node for the same forwards (padded E x C
    buffers, and the dropless one row per (token, expert)); `layers_<schedule>`: layers on each transport
    schedule now (`layers_undecided`: `auto` still timing); `forwards_<schedule>`: layer forwards run on each
    schedule so far (`auto`'s trials included)."""
    cores = layer_cores(model)
    out = sum_totals([core.traffic for core in cores])
    for name in (*SCHEDULES, None):
        out[f"layers_{name or 'undecided'}"] = sum(core.schedule == name for core in cores)
    for name in SCHEDULES:
        out[f"forwards_{name}"] = sum(core.schedule_forwards[name] for core in cores)
    return out


def balance_summary(model: torch.nn.Module) -> dict[str, float | int]:
    """Stage 2 every step on this rank's node, over all ds_cobalt layers: layer forwards refilled, and the sums over
    them of the node's per-GPU load max/mean, refilled (`stage2`) and with the re-plan's replicas (`interval`),
    so that ranks can add them up (`runtime/step_spares.BalanceCounters`)."""
    cores = layer_cores(model)
    return {"forwards": sum(c.balance.forwards for c in cores),
            "stage2_sum": float(sum(c.balance.refilled_sum for c in cores)),
            "interval_sum": float(sum(c.balance.interval_sum for c in cores))}


def schedule_summary(model: torch.nn.Module) -> list[dict]:
    """Per layer: the transport schedule in use; after an `auto` decision, each candidate's median step
    seconds (slowest rank), and, once `auto` has a choice to make, the cost model's input (`model`:
    `predicted_comm_s` per candidate, the candidates it `pruned`); `stage2`: "step", "interval" or "none" for this
    layout (None: no spare slot, or `planner.stage2: "auto"` still timing); `history`: every decision so far
    (`forward`: the layer's forward, 1-based, that it came in; `schedule`, `timings_s`, `model` as above; a dense
    choice made without trials adds `untimed_saving_share`); `stage2_history`: every timed `stage2` choice
    (`forward`, `schedule`, `stage2`, `timings_s`); `overlap`: with `overlap.enabled` on, the settings the
    hierarchical schedule runs with (`LayerCore.overlap_settings`), else None."""
    return [{"layer": i, "schedule": core.schedule, "timings_s": core.schedule_timings, "model": core.schedule_model,
             "stage2": core.stage2, "history": list(core.schedule_history),
             "stage2_history": list(core.replica_history), "overlap": core.overlap_settings}
            for i, core in enumerate(layer_cores(model))]


class CoreAccess:
    """The public per-layer attributes of a ds_cobalt layer class, read from its `cobalt_core`."""

    cobalt_core: LayerCore

    @property
    def topology(self) -> Topology:
        return self.cobalt_core.topology

    @property
    def layout_slots(self) -> np.ndarray:
        """`[W, S]` slots of this layer's current layout (EP ranks)."""
        return self.cobalt_core.layout_slots

    def set_layout(self, slots_WS: np.ndarray) -> None:
        """Use a new layout (e.g. with replica slots); owner slots must stay (moving owners is migration)."""
        self.cobalt_core.set_layout(slots_WS)

    @property
    def traffic(self) -> TrafficCounters:
        return self.cobalt_core.traffic

    @property
    def stats(self) -> DeviceRoutingStats:
        return self.cobalt_core.stats

    @property
    def tile_tuner(self) -> OverlapTuner:
        return self.cobalt_core.tuner

    @property
    def trace_rows(self) -> list[torch.Tensor] | None:
        """Top-k ids of each forward while a trace records (None otherwise)."""
        return self.cobalt_core.trace_rows

    @trace_rows.setter
    def trace_rows(self, rows: list[torch.Tensor] | None) -> None:
        self.cobalt_core.trace_rows = rows
