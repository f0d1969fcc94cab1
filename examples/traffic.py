"""Side-car accounting for the example: what DeepSpeed's own MoE layer sends across nodes, and routing traces.

Nothing here touches the hot path of either MoE implementation; everything is forward hooks.

Byte convention (shared with ``ds_cobalt.traffic_summary``): bytes leaving this rank for a rank on another
node during the forward pass, dispatch plus combine, at the activations' element size. Backward moves the
same volume again and is not counted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ds_cobalt.runtime.comm import all_reduce_host  # NCCL moves no host tensors

TRAFFIC_KEYS = (
    "inter_node_bytes",
    "intra_node_bytes",
    "deepspeed_inter_node_bytes_padded",
    "deepspeed_inter_node_bytes_dropless",
    "steps",
)


def summed_over_ranks(counters: dict[str, int], keys: list[str] | tuple[str, ...]) -> dict[str, int]:
    """`counters` with `keys` summed over every rank (one all-reduce; collective), the other entries as they are: a
    rank's own view sends its routes out and its experts' rows back, which differ where the load is uneven."""
    total = all_reduce_host(torch.tensor([counters[k] for k in keys], dtype=torch.float64))
    return {**counters, **{k: int(v) for k, v in zip(keys, total.tolist())}}


class DeepSpeedTrafficMeter:
    """Counts the all-to-all bytes of every ``deepspeed.moe.layer.MoE`` layer in ``model`` on this rank.

    ``inter_node_bytes`` / ``intra_node_bytes`` are what DeepSpeed actually sends (its padded ``[E, C, D]``
    buffers), so for this implementation ``inter_node_bytes == deepspeed_inter_node_bytes_padded``.
    ``deepspeed_inter_node_bytes_dropless`` counts one row per (token, expert) whose expert lives on a
    remote node, after capacity drops (the gate's dispatch mask or routes), as ds_cobalt's layers count it.
    """

    def __init__(self, model: nn.Module, ranks_per_node: int) -> None:
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        self.ranks_per_node = ranks_per_node
        self.rank = dist.get_rank()
        self.totals = dict.fromkeys(TRAFFIC_KEYS, 0)
        self.layers = [m for m in model.modules() if isinstance(m, DeepSpeedMoE)]
        self.demand_LE = [torch.zeros(layer.num_experts, dtype=torch.float64) for layer in self.layers]
        for layer in self.layers:
            layer.deepspeed_moe.experts.register_forward_pre_hook(self._make_hook(layer))
            layer.deepspeed_moe.gate.register_forward_hook(self._make_count_hook(layer))

    def _node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _ep_ranks(self, layer: nn.Module) -> list[int]:
        group = layer.deepspeed_moe.ep_group
        return dist.get_process_group_ranks(group) if group is not None else [self.rank]

    def _make_hook(self, layer: nn.Module) -> Any:
        def hook(_mod: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0]  # [ep_size, num_local_experts, C, D], after the dispatch all-to-all
            ep_size, n_local, cap, d = x.shape
            row = d * x.element_size() * n_local * cap  # one peer's chunk
            remote = sum(self._node(r) != self._node(self.rank) for r in self._ep_ranks(layer))
            local_peers = sum(
                self._node(r) == self._node(self.rank) and r != self.rank for r in self._ep_ranks(layer)
            )
            # dispatch + combine move the same padded chunks
            self.totals["inter_node_bytes"] += 2 * remote * row
            self.totals["deepspeed_inter_node_bytes_padded"] += 2 * remote * row
            self.totals["intra_node_bytes"] += 2 * local_peers * row

        return hook

    def _make_count_hook(self, layer: nn.Module) -> Any:
        def hook(_mod: nn.Module, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
            E = layer.num_experts
            if len(output) == 4:  # (l_aux, combine_weights, dispatch_mask [S, E, C], exp_counts)
                kept_E = output[2].sum(dim=(0, 2))
            else:  # sparse routes: (l_aux, C, E, expert ids [k, S] with -1 where dropped, ..., exp_counts)
                ids = output[3].reshape(-1).long()
                kept_E = torch.bincount(ids[ids >= 0], minlength=E)
            # exp_counts: [E] tokens of this rank choosing expert e (before drops)
            kept_E, demand_E = torch.stack([kept_E.double(), output[-1].double()]).cpu()  # NOTE: host sync
            d = inputs[0].shape[-1]
            elsize = inputs[0].element_size()
            ranks = self._ep_ranks(layer)
            n_local = layer.num_local_experts
            owner_node = np.array([self._node(ranks[e // n_local]) for e in range(E)])
            remote = owner_node != self._node(self.rank)
            rows = int(kept_E.numpy()[remote].sum())
            self.totals["deepspeed_inter_node_bytes_dropless"] += 2 * rows * d * elsize
            self.demand_LE[self.layers.index(layer)] += demand_E

        return hook

    def expert_rows_per_rank(self) -> list[float]:
        """Collective. Rows each EP rank's experts were asked for (routing demand, before capacity drops)."""
        rows = [0.0] * len(self._ep_ranks(self.layers[0])) if self.layers else []
        for layer, demand in zip(self.layers, self.demand_LE):
            total = all_reduce_host(demand.clone())
            for e, count in enumerate(total.tolist()):
                rows[e // layer.num_local_experts] += count
        return rows

    def summary(self, steps: int) -> dict[str, int]:
        out = dict(self.totals)
        out["steps"] = steps
        return out


class RoutingRecorder:
    """Records each gate's routing (``[K, T]`` expert ids after capacity, -1 = dropped) on this rank.

    Hooks every ``deepspeed.moe.sharded_moe.TopKGate`` (both MoE implementations route through it) and
    writes the DESIGN.md routing-trace ``.npz`` on rank 0: ``experts [L, T, K]``, ``num_experts``,
    ``source_rank [T]``.
    """

    def __init__(self, model: nn.Module) -> None:
        from deepspeed.moe.sharded_moe import TopKGate

        self.gates = [m for m in model.modules() if isinstance(m, TopKGate)]
        self.num_experts = int(self.gates[0].wg.weight.shape[0]) if self.gates else 0
        self.per_layer: list[list[np.ndarray]] = [[] for _ in self.gates]
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(self._make_hook(i))

    def _make_hook(self, i: int) -> Any:
        def hook(_mod: nn.Module, _inputs: Any, output: tuple[Any, ...]) -> None:
            ids = output[3]
            if isinstance(ids, (list, tuple)):
                ids = torch.stack(list(ids))
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:  # [K, T] from sparse routes
                self.per_layer[i].append(ids.detach().to("cpu", torch.int16).T.numpy())

        return hook

    def save(self, path: str) -> None:
        """Collective: gathers every rank's tokens to rank 0, which writes ``path``."""
        local = np.stack([np.concatenate(chunks) for chunks in self.per_layer])  # [L, T_r, K]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        if dist.get_rank() == 0:
            experts = np.concatenate(gathered, axis=1).astype(np.int32)
            source_rank = np.concatenate([np.full(g.shape[1], r, np.int32) for r, g in enumerate(gathered)])
            np.savez_compressed(
                path, experts=experts, num_experts=np.int64(self.num_experts), source_rank=source_rank
            )
