"""`ds_cobalt.MoE`: DeepSpeed's MoE layer with ds_cobalt's layout-aware, deduplicating dispatcher.

Same constructor, parameter names and return value `(output, l_aux, exp_counts)` as
`deepspeed.moe.layer.MoE`, so state dicts, optimizer groups (`split_params_into_different_moe_groups_for_optimizer`),
expert-data-parallel reduction and ZeRO-1/2 are unchanged. The gate is DeepSpeed's own `TopKGate`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

from ..config import CobaltConfig
from ..planner.layout import contiguous_layout
from ..runtime.moe_exchange import moe_exchange, slot_experts
from ..runtime.overlap import SlotExpert
from ..runtime.placement import LayerPlacement, build_placement
from ..runtime.replicas import ReplicaPlan, plan_replicas
from ..runtime.stats import DeviceRoutingStats
from ..runtime.tile_tuner import OverlapTuner
from ..runtime.topology import EPGroups, Topology, build_ep_groups, detect_ranks_per_node
from ..runtime.traffic import TrafficCounters
from .expert_state import Piece


class MoE(DeepSpeedMoE):
    """Drop-in for `deepspeed.moe.layer.MoE`.

    Differences: `drop_tokens` defaults to False (dropless); pass True for DeepSpeed's capacity
    semantics. Tutel and expert tensor parallelism are not supported. `cobalt_config` may also be
    applied later by `ds_cobalt.initialize` (via `configure_cobalt`).
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, use_residual: bool = False, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = False, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False, top2_2nd_expert_sampling: bool = True,
                 *, cobalt_config: CobaltConfig | None = None) -> None:
        if use_tutel:
            raise ValueError("ds_cobalt.MoE: use_tutel=True is not supported (ds_cobalt replaces the dispatcher)")
        if enable_expert_tensor_parallelism:
            raise ValueError("ds_cobalt.MoE: enable_expert_tensor_parallelism=True is not supported yet")
        if num_experts % ep_size != 0:
            raise ValueError(f"ds_cobalt.MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}")
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        self.cobalt_config = cobalt_config or CobaltConfig()
        self.traffic = TrafficCounters()
        self._groups: EPGroups | None = None
        self._placement: LayerPlacement | None = None
        self._replica_plan: ReplicaPlan | None = None
        self.stats = DeviceRoutingStats(num_experts, k)
        self.tile_tuner = OverlapTuner()
        self.trace_rows: list[torch.Tensor] | None = None  # top-k ids per forward while a trace records

    # ----- setup -----------------------------------------------------------------------------------
    def configure_cobalt(self, config: CobaltConfig) -> None:
        if self._groups is not None:
            raise RuntimeError("configure_cobalt must run before deepspeed.initialize creates the process groups")
        self.cobalt_config = config

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        super()._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        ranks_per_node = detect_ranks_per_node(dist.get_world_size(), self.cobalt_config.topology.ranks_per_node,
                                               rank=dist.get_rank())
        self._set_groups(build_ep_groups(self.deepspeed_moe.ep_group, ranks_per_node))

    def _set_groups(self, groups: EPGroups) -> None:
        self._groups = groups
        topo = groups.topology
        self.set_layout(contiguous_layout(self.num_experts, topo.nodes, topo.ranks_per_node).layer(0))

    @property
    def topology(self) -> Topology:
        return self._require_groups().topology

    @property
    def layout_slots(self) -> np.ndarray:
        """`[W, S]` slots of this layer's current layout (EP ranks)."""
        if self._placement is None:
            raise RuntimeError("ds_cobalt.MoE has no layout before its process groups exist")
        return self._placement.slots_WS

    def set_layout(self, slots_WS: np.ndarray) -> None:
        """Use a new layout for this layer. Owner slots must stay as they are (moving owners is migration)."""
        groups = self._require_groups()
        topo = groups.topology
        slots_WS = np.asarray(slots_WS, dtype=np.int64)
        if slots_WS.ndim != 2 or slots_WS.shape[0] != topo.world_size:
            raise ValueError(f"layout slots must be [{topo.world_size}, S], got {list(slots_WS.shape)}")
        per_rank = self.num_local_experts
        if self._placement is not None and not np.array_equal(
                slots_WS[:, :per_rank], self._placement.slots_WS[:, :per_rank]):
            raise ValueError("set_layout: owner slots differ from the current layout; moving owners needs migration")
        self._install_layout(slots_WS)

    def _install_layout(self, slots_WS: np.ndarray) -> None:
        """Switch lookup tables to `slots_WS`; the caller guarantees the owner parameters match it."""
        topo = self._require_groups().topology
        device = self.deepspeed_moe.gate.wg.weight.device
        self._placement = build_placement(slots_WS, topo.ranks_per_node, self.num_experts, device)
        self._replica_plan = plan_replicas(self._placement, topo.rank)

    def _require_groups(self) -> EPGroups:
        if self._groups is None:
            if self.ep_size == 1 and not (dist.is_available() and dist.is_initialized()):
                self._set_groups(EPGroups(Topology(1, 1, 0), (0,), None, None, None))
            else:
                raise RuntimeError("ds_cobalt.MoE needs its process groups: call deepspeed.initialize "
                                   "(or ds_cobalt.initialize / set_deepspeed_parallelism) first")
        return self._groups

    # ----- forward ---------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        groups = self._require_groups()
        moe = self.deepspeed_moe
        d_model = hidden_states.shape[-1]
        x_TD = hidden_states.reshape(-1, d_model)
        # DeepSpeed's gate, sparse form: [K, T] expert ids (-1 = dropped) and weights.
        l_aux, capacity, _, ids_KT, _, weights_KT, exp_counts = moe.gate(x_TD, used_token, True, False)
        moe.l_aux, moe.exp_counts = l_aux, exp_counts
        topk_ids_TK = ids_KT.t().long()
        self.stats.update(topk_ids_TK)
        if self.trace_rows is not None:
            self.trace_rows.append(topk_ids_TK.detach().cpu())

        slots, anchor = self._slot_experts(groups)
        output, traffic = moe_exchange(x_TD, topk_ids_TK, weights_KT.t(), self._placement, groups, slots,
                                       overlap=self.cobalt_config.overlap, tuner=self.tile_tuner,
                                       deepspeed_capacity=int(capacity), backend=self.cobalt_config.kernels.backend)
        output = output.reshape(hidden_states.shape)
        if anchor is not None:
            output = output + anchor
        self.traffic.add(traffic)

        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.nn.functional.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, exp_counts

    def _slot_experts(self, groups: EPGroups) -> tuple[list[SlotExpert | None], torch.Tensor | None]:
        """The expert of each slot of this rank: owner experts, then replicas with fetched weights."""
        experts = list(self.deepspeed_moe.experts.deepspeed_experts)
        names = tuple(name for name, _ in experts[0].named_parameters())
        owner = [tuple(p for _, p in expert.named_parameters()) for expert in experts]
        return slot_experts(experts[0], names, owner, self._placement, self._replica_plan, groups)

    # ----- migration (integrations/migration.py) ------------------------------------------------------
    def expert_state_pieces(self, slot: int) -> list[Piece]:
        """The parameters of the expert in owner slot `slot` (whole parameters)."""
        return [(p, None) for p in self.deepspeed_moe.experts.deepspeed_experts[slot].parameters()]

    @property
    def model_dim(self) -> int:
        return int(self.deepspeed_moe.gate.wg.weight.shape[1])
