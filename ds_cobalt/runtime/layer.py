"""`LayerCore`: the per-layer state and forward tail that every ds_cobalt MoE layer class shares.

Legend: T tokens on this rank, K routes per token, D hidden size, E experts, W EP ranks, S slots per rank.

A layer class (`ds_cobalt.MoE`, the converted AutoEP layer) runs its own router and owns its expert weights;
it holds one `LayerCore` as `cobalt_core`, which owns everything else: the process groups, the placement and
replica plan, routing statistics, traffic counters, the overlap tuner and the trace buffer. Migration,
checkpoints, replanning, traces and the HF callback talk to the core only, through this protocol:

- `attach(groups, device)`, `topology`, `groups`, `layout_slots`, `set_layout`, `install_layout`;
- `run(x_TD, topk_ids_TK, weights_TK, experts, deepspeed_capacity)`: the routed MoE output;
- `expert_state_pieces(slot)`: the training state of the expert in an owner slot;
- `call_before_next_forward(fn)`: run `fn` right before the layer's next forward (a migration commit).

Counting wraps the exchange: the exchange reports split sizes, the core turns them into `StepTraffic`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from ..kernels import resolve_backend
from ..planner.layout import contiguous_layout
from .dispatch import deepspeed_remote_routes
from .moe_exchange import OverlapSettings, moe_exchange, slot_experts
from .placement import LayerPlacement, build_placement
from .replicas import ReplicaPlan, plan_replicas
from .stats import DeviceRoutingStats
from .tile_tuner import OverlapTuner
from .topology import EPGroups, Topology
from .traffic import StepTraffic, TrafficCounters

# A piece of an expert's training state: a whole parameter (`row=None`) or one row of a fused tensor.
Piece = tuple[torch.nn.Parameter, "int | None"]


@dataclass(frozen=True)
class ExpertBinding:
    """How this rank's experts compute: `module` applied with `names` bound to the tensors of one owner slot
    (`owner_tensors[s]`), or to a replica's fetched weights."""

    module: torch.nn.Module
    names: tuple[str, ...]
    owner_tensors: Sequence[tuple[torch.Tensor, ...]]


class _Settings(Protocol):
    """What the core reads of the `"cobalt"` section (`ds_cobalt.config.CobaltConfig`)."""

    @property
    def overlap(self) -> OverlapSettings: ...

    @property
    def kernels(self) -> "_KernelSettings": ...


class _KernelSettings(Protocol):
    backend: str


class LayerCore:
    """Per-layer ds_cobalt state; see the module docstring for the protocol."""

    def __init__(self, *, num_experts: int, top_k: int, owner_slots: int, model_dim: int, settings: _Settings,
                 owner: torch.nn.Module, pieces: Callable[[int], list[Piece]],
                 device: Callable[[], torch.device]) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_local_experts = owner_slots  # owner slots per rank
        self.model_dim = model_dim
        self.settings = settings
        self.stats = DeviceRoutingStats(num_experts, top_k, device=device(), planning=False)
        self.traffic = TrafficCounters()
        self.tuner = OverlapTuner()
        self.trace_rows: list[torch.Tensor] | None = None  # top-k ids per forward while a trace records
        self._owner = weakref.ref(owner)
        self._pieces = pieces
        self._groups: EPGroups | None = None
        self._placement: LayerPlacement | None = None
        self._replica_plan: ReplicaPlan | None = None
        self._device = device  # where the layer's weights are now (lookup tables follow them)
        self._backend: tuple[torch.device, str] | None = None  # (device, kernel backend resolved for it)

    # ----- groups and layout -----------------------------------------------------------------------
    def attach(self, groups: EPGroups) -> None:
        """Use `groups` and DeepSpeed's contiguous layout."""
        self._groups = groups
        topo = groups.topology
        self.install_layout(contiguous_layout(self.num_experts, topo.nodes, topo.ranks_per_node).layer(0))

    def configure(self, settings: _Settings) -> None:
        if self._groups is not None:
            raise RuntimeError("configure_cobalt must run before deepspeed.initialize creates the process groups")
        self.settings = settings

    @property
    def attached(self) -> bool:
        return self._groups is not None

    @property
    def groups(self) -> EPGroups:
        if self._groups is None:
            raise RuntimeError("ds_cobalt layer has no process groups yet: call deepspeed.initialize "
                               "(or ds_cobalt.initialize / set_deepspeed_parallelism) first")
        return self._groups

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    @property
    def placement(self) -> LayerPlacement:
        if self._placement is None:
            raise RuntimeError("ds_cobalt layer has no layout before its process groups exist")
        return self._placement

    @property
    def layout_slots(self) -> np.ndarray:
        """`[W, S]` slots of this layer's current layout (EP ranks)."""
        return self.placement.slots_WS

    def backend(self, device: torch.device) -> str:
        """The kernel backend ("torch" or "cupy"), resolved once per device."""
        if self._backend is None or self._backend[0] != device:
            self._backend = (device, resolve_backend(self.settings.kernels.backend, device=device))
        return self._backend[1]

    def set_layout(self, slots_WS: np.ndarray) -> None:
        """Use a new layout (e.g. other replica slots). Owner slots must stay as they are (moving owners is
        migration: `ds_cobalt.integrations.migration.migrate`)."""
        topo = self.topology
        slots_WS = np.asarray(slots_WS, dtype=np.int64)
        if slots_WS.ndim != 2 or slots_WS.shape[0] != topo.world_size:
            raise ValueError(f"layout slots must be [{topo.world_size}, S], got {list(slots_WS.shape)}")
        P = self.num_local_experts
        if self._placement is not None and not np.array_equal(slots_WS[:, :P], self._placement.slots_WS[:, :P]):
            raise ValueError("set_layout: owner slots differ from the current layout; moving owners needs migration")
        self.install_layout(slots_WS)

    def install_layout(self, slots_WS: np.ndarray) -> None:
        """Switch the lookup tables to `slots_WS`; the caller guarantees the owner weights match it."""
        topo = self.topology
        self._placement = build_placement(slots_WS, topo.ranks_per_node, self.num_experts, self._device())
        self._replica_plan = plan_replicas(self._placement, topo.rank)

    # ----- training state and hooks ----------------------------------------------------------------
    def expert_state_pieces(self, slot: int) -> list[Piece]:
        """The training state of the expert in owner slot `slot`, as pieces."""
        return self._pieces(slot)

    def call_before_next_forward(self, fn: Callable[[], None]) -> None:
        """Run `fn()` once, right before the layer's next forward (before its router)."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError("ds_cobalt layer core outlived its layer")
        handle = None

        def pre_hook(module: torch.nn.Module, args: tuple) -> None:
            handle.remove()
            fn()

        handle = owner.register_forward_pre_hook(pre_hook)

    # ----- forward ---------------------------------------------------------------------------------
    def run(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor, experts: ExpertBinding,
            deepspeed_capacity: int = 0) -> torch.Tensor:
        """`[T, D]` weighted expert outputs for the router's `topk_ids_TK` (int, -1 = dropped) and
        `weights_TK`. `deepspeed_capacity`: C of DeepSpeed's padded E x C buffers (0 = none), for the counters."""
        groups, placement = self.groups, self.placement
        self.stats.update(topk_ids_TK)
        if self.trace_rows is not None:
            self.trace_rows.append(topk_ids_TK.detach().cpu())
        slots, anchor = slot_experts(experts.module, experts.names, experts.owner_tensors, placement,
                                     self._replica_plan, groups)
        out_TD, counts = moe_exchange(x_TD, topk_ids_TK, weights_TK, placement, groups, slots,
                                      overlap=self.settings.overlap, tuner=self.tuner,
                                      backend=self.backend(x_TD.device))
        if anchor is not None:
            out_TD = out_TD + anchor
        row_bytes = x_TD.shape[1] * x_TD.element_size()
        self.traffic.add(StepTraffic.measure(counts, row_bytes=row_bytes, topology=groups.topology,
                                             experts_per_rank=placement.owner_slots_per_rank,
                                             deepspeed_capacity=deepspeed_capacity))
        self.traffic.add_deepspeed_routes(deepspeed_remote_routes(topk_ids_TK, self.num_experts, groups.topology),
                                          row_bytes)
        return out_TD
