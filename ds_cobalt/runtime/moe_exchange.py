"""One MoE layer's token exchange and expert compute, whatever the layer class around it.

Legend: T tokens, K routes per token, D hidden size, S slots on this rank.

`slot_experts` lists the expert of each slot of this rank (owner experts, then replicas with weights fetched
from their owners); `moe_exchange` moves the routed tokens to those slots and back, either in phases
(`plan_layer` -> replica fetch -> `dispatch_planned` -> `run_experts` -> `combine`) or with the overlapped
schedule (`overlap.overlapped_moe`). In phases, with `spares`, the node refills its spare slots from this
forward's loads (`step_spares`) and the fetch follows the refill.
Both `ds_cobalt.MoE` and the converted AutoEP layers run through here, so they share every feature.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from torch.func import functional_call

from .dispatch import combine, dispatch_planned, plan_layer
from .experts import run_experts
from .overlap import SlotExpert, overlapped_moe
from .placement import LayerPlacement
from .replicas import ReplicaPlan, fetch_replicas
from .step_spares import NodeSpares, StepFill
from .tile_tuner import OverlapTuner
from .topology import EPGroups
from .traffic import ExchangeCounts

# A child of DeepSpeed's logger (by name, no import): messages use its handlers and level.
_log = logging.getLogger("DeepSpeed").getChild("ds_cobalt")


def slot_experts(module: torch.nn.Module, names: tuple[str, ...], owner_tensors: Sequence[tuple[torch.Tensor, ...]],
                 slots_per_rank: int, replica_plan: ReplicaPlan | None, groups: EPGroups,
                 owner_modules: Sequence[torch.nn.Module] | None = None,
                 ) -> tuple[list[SlotExpert | None], torch.Tensor | None]:
    """The expert of each slot: `module` applied with `names` bound to the owner tensors of each owner slot
    (or `owner_modules[s]` itself, whose parameters they are), then to fetched replica weights. The anchor (or
    None) must be added to the layer output so replica gradients flow back to their owners."""
    slots: list[SlotExpert | None] = [
        SlotExpert(module, names, tuple(t), None if owner_modules is None else owner_modules[i])
        for i, t in enumerate(owner_tensors)]
    if replica_plan is None or slots_per_rank == len(owner_tensors):
        return slots, None
    fetched, anchor = fetch_replicas([list(t) for t in owner_tensors], replica_plan, groups)
    for slot in range(len(owner_tensors), slots_per_rank):
        tensors = fetched.get(slot)
        slots.append(None if tensors is None else SlotExpert(module, names, tuple(tensors)))
    return slots, anchor


def bind(slot: SlotExpert) -> Callable[[torch.Tensor], torch.Tensor]:
    if slot.own_module is not None:
        return slot.own_module  # its own parameters: no functional_call (which swaps every tensor per call)
    tensors = dict(zip(slot.names, slot.tensors))
    return lambda rows: functional_call(slot.module, tensors, (rows,))


class OverlapSettings(Protocol):
    """What `moe_exchange` reads of the overlap settings (`ds_cobalt.config.OverlapConfig`)."""

    enabled: bool | str
    tile_rows: int | str
    rail_chunks: int | str


# `slots_for(step_slots_WS)`: the slot experts and anchor (`slot_experts`) for the layout's replicas (None) or for
# this forward's refilled layout
SlotsFor = Callable[[np.ndarray | None], tuple[list[SlotExpert | None], torch.Tensor | None]]


def moe_exchange(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 placement: LayerPlacement, groups: EPGroups, slots_for: SlotsFor, *,
                 overlap: OverlapSettings, tuner: OverlapTuner, backend: str,
                 capacity: tuple[torch.Tensor | int, bool] = (0, False), spares: NodeSpares | None = None,
                 replay: bool = False, tune: bool = True) -> tuple[torch.Tensor, ExchangeCounts, StepFill | None]:
    """`[T, D]` combined expert outputs (router weights applied), the exchange's split sizes and this forward's
    refill (None without `spares` or with the overlapped schedule, which keeps the layout's replicas).

    `"auto"` overlap settings let `tuner` pick them from a few timed forwards. `capacity`: DeepSpeed's
    capacity for the counters and whether it is this rank's value (the largest over the group is wanted).
    `replay`: the recomputation of the last forward (activation checkpointing) runs its overlap settings again.
    `tune=False`: the `"auto"` settings run what `tuner` has chosen so far (else its guesses), timing nothing."""
    choice = None
    if overlap.enabled and replay:
        choice = tuner.replay()
    elif overlap.enabled:
        choice = tuner.settings(x_TD.shape[1] * x_TD.element_size(), overlap.tile_rows, overlap.rail_chunks,
                                overlap.enabled, tune)
    timed = choice.timed if choice is not None else None
    started = timed.start(x_TD.device) if timed is not None else None
    fill = None
    if choice is not None and choice.overlap:
        slots, anchor = slots_for(None)
        out_TD, counts = overlapped_moe(x_TD, topk_ids_TK, weights_TK, placement, groups, slots, choice.tile_rows,
                                        backend, choice.rail_chunks, capacity)
    else:
        out_TD, counts, fill, anchor = _phased(x_TD, topk_ids_TK, weights_TK, placement, groups, slots_for, backend,
                                               capacity, spares)
    if timed is not None:
        timed.record(started, x_TD.device, groups)
        if timed.chosen is not None and groups.topology.rank == 0:
            _log.info("ds_cobalt overlap: chose %s from %s (forward seconds %s)", tuner.chosen(),
                      timed.candidates, [round(t, 5) for t in timed.times])
    return (out_TD if anchor is None else out_TD + anchor), counts, fill


def _phased(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor, placement: LayerPlacement,
            groups: EPGroups, slots_for: SlotsFor, backend: str, capacity: tuple[torch.Tensor | int, bool],
            spares: NodeSpares | None) -> tuple[torch.Tensor, ExchangeCounts, StepFill | None, torch.Tensor | None]:
    layer = plan_layer(topk_ids_TK, placement, groups, backend, *capacity, spares=spares)
    slots, anchor = slots_for(None if layer.fill is None else layer.fill.slots_WS)
    rows_QD, handle = dispatch_planned(x_TD, weights_TK, layer, groups, placement.slots_per_rank, backend)
    out_QD = run_experts(rows_QD, handle.expert_slot_Q, handle.slot_counts,
                         [None if slot is None else bind(slot) for slot in slots])
    return combine(out_QD, handle, groups), handle.counts, layer.fill, anchor
