"""`ds_cobalt.MoE`: DeepSpeed's MoE layer with ds_cobalt's layout-aware, deduplicating dispatcher.

Same constructor, parameter names and return value `(output, l_aux, exp_counts)` as
`deepspeed.moe.layer.MoE`, so state dicts, optimizer groups (`split_params_into_different_moe_groups_for_optimizer`),
expert-data-parallel reduction and ZeRO-1/2 are unchanged. The gate is DeepSpeed's own `TopKGate`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.moe.sharded_moe import MOE_TIMER

from ..config import CobaltConfig
from ..runtime.comm import timed_exchanges
from ..runtime.layer import ExpertBinding, LayerCore, Piece
from ..runtime.topology import EPGroups, Topology, build_ep_groups, detect_ranks_per_node
from .layers import CoreAccess

ONE_RANK = EPGroups(Topology(1, 1, 0), (0,), None, None, None)  # a layer on its own: every exchange a local copy


class MoE(CoreAccess, DeepSpeedMoE):
    """Drop-in for `deepspeed.moe.layer.MoE`.

    Differences: `drop_tokens` defaults to False (dropless); pass True for DeepSpeed's capacity
    semantics. Tutel and expert tensor parallelism are not supported. `cobalt_config` may also be
    applied later by `ds_cobalt.initialize` (via `configure_cobalt`). ds_cobalt's per-layer state lives in
    `cobalt_core` (`ds_cobalt.runtime.layer.LayerCore`).
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
        if isinstance(k, float) and k.is_integer():
            k = int(k)  # a JSON config may give 2.0; DeepSpeed's gate runs it as top-2
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_experts:
            raise ValueError(f"ds_cobalt.MoE: k must be an int in [1, num_experts={num_experts}], got {k!r}")
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
                         enable_expert_tensor_parallelism, top2_2nd_expert_sampling)
        self.cobalt_config = cobalt_config or CobaltConfig()
        self.cobalt_core = self._new_core()
        self._early_core: LayerCore | None = None  # `_forward_core`

    # ----- setup -----------------------------------------------------------------------------------
    def configure_cobalt(self, config: CobaltConfig) -> None:
        self.cobalt_core.configure(config)
        self.cobalt_config = config

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        super()._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        ranks_per_node = detect_ranks_per_node(dist.get_world_size(), self.cobalt_config.topology.ranks_per_node,
                                               rank=dist.get_rank())
        self.cobalt_core.attach(build_ep_groups(self.deepspeed_moe.ep_group, ranks_per_node,
                                                     self.cobalt_config.topology.group_timeout_s))

    def _new_core(self) -> LayerCore:
        return LayerCore(num_experts=self.num_experts, top_k=self.deepspeed_moe.gate.k,
                         owner_slots=self.num_local_experts, model_dim=self.model_dim, settings=self.cobalt_config,
                         owner=self, pieces=self.expert_state_pieces, device=self.weights_device)

    def weights_device(self) -> torch.device:
        """Where the layer's weights are now (the gate's)."""
        return self.deepspeed_moe.gate.wg.weight.device

    def _ensure_groups(self) -> None:
        """A one-rank layer used without `deepspeed.initialize` gets a group of its own."""
        if not self.cobalt_core.attached and self.ep_size == 1 and not (dist.is_available() and dist.is_initialized()):
            self.cobalt_core.attach(ONE_RANK)

    def _forward_core(self) -> LayerCore:
        """The core that runs this forward. A one-rank layer that runs before `deepspeed.initialize` gave it its
        groups while torch.distributed is up (DeepSpeed's layer runs it too: a sanity pass, a tracing pass) gets
        a throwaway core on a group of its own, so that `configure_cobalt` and the groups still come later;
        nothing that core records (statistics, counters, schedule choices) is kept."""
        self._ensure_groups()
        if self.cobalt_core.attached or self.ep_size != 1:
            if self._early_core is not None:  # every forward: no module attribute write once it is gone
                self._early_core = None
            return self.cobalt_core
        if self._early_core is None or self._early_core.settings is not self.cobalt_config:
            self._early_core = self._new_core()
            self._early_core.attach(ONE_RANK)
        return self._early_core

    @property
    def topology(self) -> Topology:
        self._ensure_groups()
        return self.cobalt_core.topology

    # ----- forward ---------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        moe = self.deepspeed_moe
        if moe.wall_clock_breakdown:  # DeepSpeed's "fwd_moe" figure (`"wall_clock_breakdown": true`)
            moe.timers(MOE_TIMER).start()
        d_model = hidden_states.shape[-1]
        x_TD = hidden_states.reshape(-1, d_model)
        # DeepSpeed's gate, sparse form: [K, T] expert ids (-1 = dropped) and weights.
        local = _capacity_is_local(moe.gate)
        with _without_capacity_all_reduce(moe.gate, local):
            l_aux, capacity, _, ids_KT, locations_KT, weights_KT, exp_counts = moe.gate(x_TD, used_token, True, False)
        moe.l_aux, moe.exp_counts = l_aux, exp_counts
        experts = list(moe.experts.deepspeed_experts)
        binding = ExpertBinding(experts[0], tuple(name for name, _ in experts[0].named_parameters()),
                                [tuple(expert.parameters()) for expert in experts], experts)
        with timed_exchanges(get_accelerator().synchronize) if moe.wall_clock_breakdown else nullcontext() as times:
            output = self._forward_core().run(x_TD, ids_KT.t().long(), weights_KT.t(), binding, capacity, local,
                                              locations_KT.t(), training=self.training)
        output = output.reshape(hidden_states.shape)
        if moe.wall_clock_breakdown:
            moe.timers(MOE_TIMER).stop()
            moe.time_moe = moe.timers(MOE_TIMER).elapsed(reset=False)
            # DeepSpeed's two all-to-alls: the first half of the forward's row exchanges (the dispatch side, with a
            # replica fetch) and the second half (the combine side), in ms as its timers give them
            half = (len(times) + 1) // 2
            moe.time_falltoall, moe.time_salltoall = 1e3 * sum(times[:half]), 1e3 * sum(times[half:])

        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.nn.functional.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, l_aux, exp_counts

    # ----- training state (integrations/migration.py) ---------------------------------------------
    def expert_state_pieces(self, slot: int) -> list[Piece]:
        """The parameters of the expert in owner slot `slot` (whole parameters)."""
        return [(p, None) for p in self.deepspeed_moe.experts.deepspeed_experts[slot].parameters()]

    @property
    def model_dim(self) -> int:
        return int(self.deepspeed_moe.gate.wg.weight.shape[1])


def _capacity_is_local(gate: torch.nn.Module) -> bool:
    """Whether the gate's capacity all-reduce can be left out: dropless top-2 and top-k routes do not depend on
    the capacity (it only sizes DeepSpeed's padded buffers, which ds_cobalt does not build; its counters get
    the group's largest value from the count exchange). Top-1 keeps it: its random token selection takes
    `min(capacity, tokens)` winners per expert, and ties at zero could resolve differently."""
    return not gate.drop_tokens and gate.k >= 2


@contextmanager
def _without_capacity_all_reduce(gate: torch.nn.Module, skip: bool):
    if not skip:
        yield
        return
    ep_group, gate.ep_group = gate.ep_group, None  # DeepSpeed reduces only when the group is parallel
    try:
        yield
    finally:
        gate.ep_group = ep_group
