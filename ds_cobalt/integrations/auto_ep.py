"""DeepSpeed AutoEP layers that move their tokens through ds_cobalt's dispatcher.

With `"expert_parallel"` (AutoEP) and a `"cobalt"` section in the DeepSpeed config, DeepSpeed replaces the
model's MoE blocks by `AutoEPMoELayer`s inside `deepspeed.initialize`; `adopt_auto_ep_layers` then turns
each into a `CobaltAutoEPLayer` in place (a class change: same parameter objects, names, shapes and
DeepSpeed tags, so optimizer groups, ZeRO-1/2 partitions and checkpoints are unaffected). The router, the
shared experts and the output contract stay AutoEP's; only dispatch, expert compute and combine change.
Everything `ds_cobalt.MoE` does works here too: replica slots, re-planning and owner migration (one row of
each fused tensor, with its optimizer state, per expert: `expert_state_pieces`), logical-order and
portable checkpoints, the overlapped schedule, traces and traffic counters.

Legend: T tokens on this rank, K routes per token, D hidden size, Q rows received, F expert FFN size,
S slots per rank, W ranks of the expert-parallel group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.module_inject.auto_ep_comm import COMM_BACKEND
from deepspeed.module_inject.auto_ep_layer import (
    AutoEPMoELayer,
    RouterOutput,
    combine_from_routed,
    permute_by_local_expert,
    unpermute_by_local_expert,
)
from deepspeed.moe.ep_experts import apply_expert_activation
from deepspeed.ops.triton_ops import autoep_fused_token_ops as fused_token_ops

from ..config import CobaltConfig
from ..runtime.comm import all_to_all_rows, exchange_counts
from ..runtime.layer import ExpertBinding, LayerCore, Piece
from ..runtime.sync_free import count_keys
from ..runtime.topology import EPGroups, Topology, build_ep_groups, detect_ranks_per_node
from ..runtime.traffic import ExchangeCounts
from .layers import CoreAccess


class CobaltAutoEPLayer(CoreAccess, AutoEPMoELayer):
    """An `AutoEPMoELayer` whose dispatch/combine is ds_cobalt's two-stage deduplicating one.

    Not constructed directly: `adopt_auto_ep_layers` (called by `ds_cobalt.initialize` and by
    `ds_cobalt.hf.CobaltCallback`) converts the layers DeepSpeed built. Experts are AutoEP's fused
    `experts.w1/w2/w3` `[E_local, ...]` tensors; slot s of this rank computes with `w*[s]`. ds_cobalt's
    per-layer state lives in `cobalt_core` (`ds_cobalt.runtime.layer.LayerCore`).

    Traffic counters: AutoEP's all-to-all sends one row per (token, expert) each way, so its cross-node
    volume is `deepspeed_inter_node_bytes_dropless`; `deepspeed_inter_node_bytes_padded` stays 0 (no E x C
    buffers). The `dense` schedule (the baseline that `transport.schedule: "auto"` measures the others against)
    is AutoEP's own dropless exchange here (`autoep_exchange`), not DeepSpeed MoE's padded one.
    """

    cobalt_config: CobaltConfig
    cobalt_core: LayerCore

    @classmethod
    def adopt(cls, layer: AutoEPMoELayer, config: CobaltConfig, groups: EPGroups) -> CobaltAutoEPLayer:
        """Turn a DeepSpeed-built `AutoEPMoELayer` into this class, in place; returns the same object."""
        _check_supported(layer)
        layer.__class__ = cls
        assert isinstance(layer, cls)
        layer.cobalt_config = config
        gate = layer.router.gate.weight
        layer.cobalt_core = LayerCore(
            num_experts=layer.num_experts, top_k=layer.top_k, owner_slots=layer.num_local_experts,
            model_dim=int(gate.shape[1]), settings=config, owner=layer, pieces=layer.expert_state_pieces,
            device=layer.weights_device)
        experts = layer.experts
        # not a submodule (no parameters, not in state dicts): bound to weight rows at each call
        object.__setattr__(layer, "_expert_module", FusedExpertMLP(
            experts.activation, experts.activation_alpha, experts.activation_limit))
        layer.cobalt_core.attach(groups)
        return layer

    def weights_device(self) -> torch.device:
        """Where the layer's weights are now (the router's)."""
        return self.router.gate.weight.device

    # ----- training state (integrations/migration.py) ----------------------------------------------
    def expert_state_pieces(self, slot: int) -> list[Piece]:
        """The expert in owner slot `slot`: row `slot` of each fused tensor."""
        experts = self.experts
        return [(experts.w1, slot), (experts.w2, slot), (experts.w3, slot)]

    @property
    def model_dim(self) -> int:
        return int(self.router.gate.weight.shape[1])

    # ----- forward ---------------------------------------------------------------------------------
    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        bsz, seqlen, hdim = hidden_states.shape
        x_TD = hidden_states.reshape(-1, hdim)
        ro = RouterOutput(*self.router(x_TD, self.expert_bias))  # AutoEP's routing, unchanged
        with torch.no_grad():
            self.tokens_per_expert.add_(ro.num_tokens_per_expert)
        experts = self.experts
        binding = ExpertBinding(self._expert_module, _FUSED_NAMES,
                                [(experts.w1[s], experts.w2[s], experts.w3[s]) for s in range(self.num_local_experts)],
                                native_dense=self.autoep_exchange)
        output = self.cobalt_core.run(x_TD, ro.selected_experts.long(), ro.top_scores, binding, training=self.training)
        return self._finalize_output(output.reshape(bsz, seqlen, hdim), x_TD, hidden_states, hdim)

    def autoep_exchange(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                        owner_block_E: torch.Tensor, ep_group: dist.ProcessGroup | None
                        ) -> tuple[torch.Tensor, ExchangeCounts]:
        """AutoEP's own exchange with every expert at its owner slot of the current layout (`owner_block_E`: owner
        rank * L + owner slot): one count all-to-all and one host sync, one uneven all-to-all each way with one row
        per (token, expert), AutoEP's grouped experts, AutoEP's combine. On the contiguous layout this is plain
        AutoEP's computation, step for step; elsewhere only which rank and slot compute an expert differ."""
        T, K = topk_ids_TK.shape
        D = x_TD.shape[1]
        L = self.num_local_experts
        W = owner_block_E.numel() // L
        block_R = owner_block_E.to(x_TD.device)[topk_ids_TK.reshape(-1).long()]  # each route's owner block
        order_R = torch.argsort(block_R, stable=True)  # routes grouped by destination rank, then owner slot
        send_WL = count_keys(block_R, W * L).view(W, L)
        recv_WL = exchange_counts(send_WL, ep_group)  # what each source rank sends to each of our slots
        send, recv = torch.stack((send_WL.sum(1), recv_WL.sum(1))).tolist()  # NOTE: host sync (split sizes)
        rows_QD = all_to_all_rows(x_TD[order_R // K], send, recv, ep_group)
        rows_QD, perm_Q, aligned_L, rows = permute_by_local_expert(rows_QD, recv_WL)
        out_QD = unpermute_by_local_expert(self.experts(rows_QD, aligned_L), perm_Q, rows)
        back_RD = all_to_all_rows(out_QD, recv, send, ep_group)
        if self.combine_impl == "fused_weighted_sum":
            out_TD = fused_token_ops.fused_weighted_restore(back_RD, top_scores=weights_TK,
                                                            token_indices_sorted=order_R, top_k=K, shape=(1, T, D))
        else:
            out_TD = combine_from_routed(back_RD, top_scores=weights_TK, token_indices_sorted=order_R, top_k=K,
                                         score_apply="post", combine_impl=self.combine_impl, shape=(1, T, D))
        counts = ExchangeCounts(tokens=T, rail_send=tuple(send), rail_recv=tuple(recv), route_send=(0,) * W,
                                node_send=(0,), node_recv=(rows,))
        return out_TD.reshape(T, D), counts


_FUSED_NAMES = ("w1", "w2", "w3")


class FusedExpertMLP(torch.nn.Module):
    """AutoEP's expert MLP for one expert, `w2 @ act(w1 @ x, w3 @ x)` (w1, w3 `[F, D]`, w2 `[D, F]`), applied
    with `torch.func.functional_call` to one row of each fused tensor (or a fetched replica)."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor

    def __init__(self, activation: str, alpha: float, limit: float) -> None:
        super().__init__()
        self.act = (activation, alpha, limit)

    def forward(self, rows_QD: torch.Tensor) -> torch.Tensor:
        dtype = rows_QD.dtype
        gate = rows_QD @ self.w1.to(dtype).t()
        up = rows_QD @ self.w3.to(dtype).t()
        # fused=False: the plain-torch form (AutoEP's reference path), also on CPU
        return apply_expert_activation(gate, up, *self.act, fused=False) @ self.w2.to(dtype).t()


def _check_supported(layer: AutoEPMoELayer) -> None:
    family = getattr(layer, "model_family", "?")
    if layer.score_apply != "post":
        raise ValueError(
            f"ds_cobalt: AutoEP layer of model family {family!r} uses score_apply={layer.score_apply!r}; "
            "ds_cobalt applies router weights at combine and supports only 'post' "
            "(set expert_parallel.score_apply to 'post' only if the model allows it)"
        )
    if layer.comm_backend != COMM_BACKEND:
        raise ValueError(
            f"ds_cobalt: expert_parallel.comm_backend={layer.comm_backend!r} is not supported with a "
            f"'cobalt' section (ds_cobalt replaces the communication); use {COMM_BACKEND!r}"
        )
    if layer.folding_group_handles is not None and layer.folding_group_handles.spec.tp_size > 1:
        raise ValueError(
            "ds_cobalt: AutoEP with tensor-parallel folding (tensor_parallel.autotp_size > 1) is not "
            "supported with a 'cobalt' section"
        )


def auto_ep_layers(model: torch.nn.Module) -> list[AutoEPMoELayer]:
    """The AutoEP layers of a model (or engine), converted or not, in module order."""
    module = getattr(model, "module", model)
    return [m for m in module.modules() if isinstance(m, AutoEPMoELayer)]


def adopt_auto_ep_layers(
    engine: Any, config: CobaltConfig, *, zero_stage: int | None = None, expert_parallel: dict | None = None
) -> list[CobaltAutoEPLayer]:
    """Convert every AutoEP layer of `engine` (a DeepSpeedEngine, or its model) to ds_cobalt's dispatcher.

    Collective when there is something to convert (creates the node/rail groups): call it on every rank,
    right after `deepspeed.initialize`. Idempotent. `zero_stage` and `expert_parallel` (the config's
    section) default to what the engine reports; they only serve the error messages.
    Raises ValueError for unsupported combinations (ZeRO-3, AutoEP found no MoE layer, DeepEP backend, ...).
    """
    if expert_parallel is None:
        ep_config = getattr(getattr(engine, "_config", None), "expert_parallel_config", None)
        enabled = bool(ep_config is not None and ep_config.enabled)
    else:
        enabled = bool(expert_parallel.get("enabled", False))
    layers = auto_ep_layers(engine)
    if not layers:
        if enabled:
            model_config = getattr(getattr(engine, "module", engine), "config", None)
            model_type = getattr(model_config, "model_type", None)
            raise ValueError(
                f"ds_cobalt: 'expert_parallel' is enabled but AutoEP replaced no MoE layer of this model "
                f"(model_type={model_type!r}): the model family has no AutoEP preset or the preset does not "
                "match. "
                "Set expert_parallel.preset_model to a matching preset (mixtral, qwen3_moe, deepseek_v2, "
                "deepseek_v3, ...) or give expert_parallel.moe_layer_pattern/expert_pattern/router_pattern"
            )
        return []
    if zero_stage is None and hasattr(engine, "zero_optimization_stage"):
        zero_stage = engine.zero_optimization_stage()
    if zero_stage == 3:
        raise ValueError(
            "ds_cobalt: AutoEP with zero_optimization.stage=3 is not supported with a 'cobalt' section "
            "(ZeRO-3 partitions the fused expert weights that ds_cobalt's slots compute with); "
            "use stage 0, 1 or 2"
        )
    for layer in layers:  # every check before the first collective, so all ranks fail alike
        _check_supported(layer)
    adopted = []
    ranks_per_node = detect_ranks_per_node(dist.get_world_size(), config.topology.ranks_per_node,
                                           rank=dist.get_rank())
    for layer in layers:
        if isinstance(layer, CobaltAutoEPLayer):
            adopted.append(layer)
            continue
        if layer.ep_group is None and layer.ep_size > 1:
            raise RuntimeError(
                "ds_cobalt: AutoEP layer has no expert-parallel group; call deepspeed.initialize first"
            )
        ep_group = layer.ep_group if layer.ep_size > 1 else None
        groups = (build_ep_groups(ep_group, ranks_per_node, config.topology.group_timeout_s) if layer.ep_size > 1
                  else _single_rank_groups())
        adopted.append(CobaltAutoEPLayer.adopt(layer, config, groups))
    return adopted


def _single_rank_groups() -> EPGroups:
    return EPGroups(Topology(1, 1, 0), (dist.get_rank(),), None, None, None)

