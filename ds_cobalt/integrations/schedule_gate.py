"""`ScheduleGate`: `auto` tries schedules against dense only where the cost model's saving matters to the step.

`transport.schedule: "auto"` warms a layer up on the cost model's favourite, then times every candidate for a few
steps (`LayerCore`, `StepTimedChoice`). Those trials cost steps of the slower candidates, and a measured win of a
few percent is within the spread of single steps. The model prices each schedule's communication only (the CPU
work of the hierarchical and direct exchanges is not in it), so a saving it predicts that is small against the
whole step can neither be resolved by the trials nor be relied on. This step hook sums the model's saving over
dense across the layers that still make their first choice and compares it with a dense step: the layers'
warm-up windows (forward to the end of the optimizer step; the slowest rank's, one all-reduce) plus dense's
predicted excess over the favourite that ran them. Below `MATERIAL_SAVING`:
- after step 1 (`BEFORE_TRIALS_STEP`; in a resumed run, after its first step, for the layers whose first choice the
  checkpoint did not carry): no plan before the trials (`LayerCore.layout_gain_material`) for the layers
  whose model does not rule dense out, since the planner worker's CPU would be spent beside the first steps; and
  dense runs the rest of their warm-up (`LayerCore.warm_up_on_dense`), so that the check below times dense's own
  step and a layer kept on dense ran DeepSpeed's exchange from step 2. The plan before the trials runs, and moves
  the owners, only where the share is at least `OWNER_MOVE_SHARE` (`LayerCore.owner_moves_priced`; judged for every
  layer whose model priced dense, also where it rules dense out), so the first dozen steps run a layout that follows
  the routing, not the contiguous one (at 100 Mbit/s the default model's share after step 1 was 25 %; with the
  fine-grained model at 1 Gbit/s 7-15 %, where the trials then kept dense and the migrations before them were paid
  for nothing; 1.7-4.1 % on the fast links with the default model). A layer judged below it moves no owners in
  later re-plans either, whatever its trials measure (`LayerCore.owners_may_move`);
- when the warm-up ends, before the first trial (a window of the run's first step left out): the layers settle on
  dense, DeepSpeed's own exchange, with no trials (`LayerCore.settle_dense`).
A verdict that the saving is material stands for the layer's first choice: a layer whose owners the plan before
the trials may move, or that was cleared for its trials, is not checked again when a new layout restarts its
warm-up. That one warm-up step follows the migration and reads slow, and the plan only cut what the schedules
other than dense send (the fine-grained model at 1 Gbit/s: 12.5 % and 12.6 % after steps 1 and 3, then 9.2 % on the
step after 52 experts moved, which settled dense untimed after paying for the migration).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from deepspeed.utils import logger

from ..runtime.comm import slowest_rank
from ..runtime.layer import LayerCore
from .layers import layer_cores
from .replan import BEFORE_TRIALS_STEP

__all__ = ["MATERIAL_SAVING", "OWNER_MOVE_SHARE", "ScheduleGate", "immaterial_share", "saving_share"]

# the model's communication saving over dense, as a share of a dense step, below which no trials run: twice the
# trials' own margin (`layer.DENSE_MARGIN`); on the 2 x 2 testbed the saving the model priced at 6-8 % of a step
# (fine-grained model, 1 Gbit/s) measured within 2 % of DeepSpeed's steps once chosen, after trials and re-plans
# that cost ~8 % of a 60-step run, while the wins at 100 Mbit/s were priced at 20 % and more
MATERIAL_SAVING = 0.10
# ... and the share at which the plan before the trials may move the owners (checked after step 1, also where the model
# rules dense out): twice the above. At 100 Mbit/s the default model's share after step 1 was 25 % (its hierarchical
# steps then ran 1.8x DeepSpeed's); with the fine-grained model at 1 Gbit/s it was 7-15 %, and the migrations that
# followed (26-52 experts after step 3, the trials then keeping dense) cost about 4 % of a 60-step job
OWNER_MOVE_SHARE = 0.20


def saving_share(gaps: list[tuple[float, float]], warmup_step_s: float) -> float | None:
    """The model's saving over dense as a share of a dense step (None without a step to compare with).
    `gaps`: per layer, `LayerCore.predicted_dense_gaps` (dense minus the best other candidate, dense minus the
    warm-up's favourite); `warmup_step_s`: a step of the warm-up, which ran the favourites."""
    saving = sum(max(0.0, best) for best, _ in gaps)
    dense_step_s = warmup_step_s + sum(favourite for _, favourite in gaps)
    return saving / dense_step_s if dense_step_s > 0.0 else None


def immaterial_share(gaps: list[tuple[float, float]], warmup_step_s: float) -> float | None:
    """`saving_share` where it is below `MATERIAL_SAVING` (else None)."""
    share = saving_share(gaps, warmup_step_s)
    return share if share is not None and share < MATERIAL_SAVING else None


class ScheduleGate:
    """The step hook (`CobaltEngine`, with `transport.schedule` "auto"); idle once every layer's first choice is
    made."""

    def __init__(self) -> None:
        self._cores: list[LayerCore] | None = None
        self._material: set[int] = set()  # id() of the layers whose saving a check found material
        self._judged_owner_moves = False  # the check after the first step this engine ran
        # per check: step, what for, layers, step seconds, the model's saving share and that share where immaterial
        self.decisions: list[dict[str, Any]] = []

    def __call__(self, engine: Any) -> None:
        if self._cores is None:
            self._cores = layer_cores(engine)
        step = int(engine.global_steps)
        if not self._judged_owner_moves and step >= BEFORE_TRIALS_STEP:  # after step 1, or the first after a resume
            self._judged_owner_moves = True
            modelled = [core for core in self._cores if core.dense_modelled]
            for cores, share, priced in self._verdicts(step, "plan", modelled):
                for core in cores:
                    core.owner_moves_judged = priced is not None
                    core.owner_moves_priced = priced is not None and priced >= OWNER_MOVE_SHARE
                    if not core.dense_contested:  # ruled out by the model: dense is timed in the trials all the same
                        continue
                    core.layout_gain_material = share is None
                    if share is None and priced is not None:
                        self._material.add(id(core))
                    if share is not None:
                        core.warm_up_on_dense()
        contested = [core for core in self._cores if core.dense_contested and id(core) not in self._material]
        due = [core for core in contested if core.first_trials_due]
        for cores, share, priced in self._verdicts(step, "trials", due):
            if share is None:
                if priced is not None:
                    self._material.update(id(core) for core in cores)
                continue
            for core in cores:
                core.settle_dense(share)
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.info(f"ds_cobalt transport: {len(cores)} layer(s) keep the dense schedule without trials: the "
                            f"cost model's saving over it is {100 * share:.1f} % of a dense step (below "
                            f"{100 * MATERIAL_SAVING:.0f} %)")

    def _verdicts(self, step: int, purpose: str,
                  cores: list[LayerCore]) -> list[tuple[list[LayerCore], float | None, float | None]]:
        """Per EP group of `cores` (in layer order): its cores, `immaterial_share` and `saving_share` on the slowest
        rank's longest warm-up window (one all-reduce per group; the same cores on every rank of a group); each
        also goes to `decisions`."""
        out = []
        for group in _groups_in_order(cores):
            mine = [core for core in cores if core.groups.ep_group is group]
            window_s = float(slowest_rank([max((core.warmup_step_s or 0.0) for core in mine)], group)[0])
            priced = saving_share([core.predicted_dense_gaps() for core in mine], window_s) if window_s else None
            share = priced if priced is not None and priced < MATERIAL_SAVING else None
            self.decisions.append({"step": step, "for": purpose, "layers": len(mine), "step_s": window_s,
                                   "saving_share": priced, "immaterial_share": share})
            out.append((mine, share, priced))
        return out


def _groups_in_order(cores: list[LayerCore]) -> list:
    """The distinct EP groups of `cores`, in layer order (the same on every rank of a group)."""
    return list({id(core.groups.ep_group): core.groups.ep_group for core in cores}.values())
