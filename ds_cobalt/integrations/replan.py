"""Online stage-1 replanning: statistics -> planner (background thread on rank 0) -> migration.

Legend: L ds_cobalt layers, E experts, K top-k, W EP ranks, S slots per rank, P = E / W owner slots,
B sample rows per rank and layer, R world ranks.

Timeline (every rank runs the same hook after each optimizer step, so decisions line up without extra
per-step collectives):
- after step s with s % replan_interval == 0: one all_reduce (sum) of every layer's load, co-activation,
  token count and up to B recent top-k rows per rank; statistics reset; rank 0 starts the planner thread.
- after step s + apply_lag: rank 0 joins the thread; one broadcast carries the per-layer decision and
  slots; every rank applies it (replica-only changes with `set_layout`, owner changes with `migrate`).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import logger

from ..config import CobaltConfig
from ..planner import LinkModel
from ..planner.decisions import KEEP, MIGRATE, REPLICAS, LayerDecision, LayerStats, plan_layer_decision
from ..runtime.layer import LayerCore
from ..runtime.link_probe import probe_links
from .expert_state import piece_numel
from .migration import migratable_layers, migrate

# The pure decision lives in the planner; these names stay importable from here.
__all__ = ["Replanner", "KEEP", "REPLICAS", "MIGRATE", "LayerStats", "LayerDecision", "plan_layer_decision"]


class Replanner:
    """The step hook. One instance per engine; see the module docstring for the timeline."""

    def __init__(self, engine: Any, cobalt: CobaltConfig) -> None:
        self.layers: list[LayerCore] = migratable_layers(engine)
        self.cfg = cobalt.planner
        self.mig = cobalt.migration
        self._thread: threading.Thread | None = None
        self._result: list[LayerDecision] | None = None
        self._error: str | None = None
        self._apply_at: int | None = None
        self._interval = self.cfg.replan_interval
        if not self.layers:
            return
        for layer in self.layers:
            layer.stats.planning = True  # co-activation and samples are counted only for a replanner
        first = self.layers[0]
        pieces = first.expert_state_pieces(0)
        elem = pieces[0][0].element_size()
        expert_params = sum(piece_numel(piece) for piece in pieces)
        gbps = self.mig.inter_node_gbps
        if gbps is None:  # measured: the probe's cross-node bytes/s (collective, every rank at start-up)
            costs = probe_links(first.groups, pieces[0][0].device)
            engine.cobalt_link_costs = costs
            gbps = costs.inter_node_gbps if costs.inter_node_bytes_per_s != float("inf") else 1e3
            if dist.is_initialized() and dist.get_rank() == 0:
                logger.info(f"ds_cobalt link probe: {costs.fixed_s * 1e3:.3f} ms per collective, cross-node "
                            f"{costs.inter_node_gbps:.3f} Gbit/s, inside a node "
                            f"{costs.intra_node_bytes_per_s * 8 / 1e9:.3f} Gbit/s (migration cost model)")
        self.link = LinkModel(expert_params=expert_params, weight_bytes_per_param=elem,
                              optimizer_bytes_per_param=12, token_bytes=elem * first.model_dim,
                              inter_node_gbps=gbps, margin=self.mig.margin)

    def __call__(self, engine: Any) -> None:
        if not self.layers:
            return
        step = int(engine.global_steps)
        if self._apply_at is not None and step >= self._apply_at:
            self._apply(engine)
        if step % self._interval == 0:
            self._start(engine, step)
            if self.cfg.effective_apply_lag == 0:
                self._apply(engine)

    # ----- statistics and planning -----
    def _gather(self) -> list[LayerStats]:
        """One all_reduce over the world: summed load/co-activation/tokens and every rank's samples."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        B = self.cfg.sample_tokens
        pieces: list[torch.Tensor] = []
        for layer in self.layers:
            load_E, coact_EE, sample_BK = layer.stats.snapshot()
            K = sample_BK.shape[1]
            samples = np.zeros((world, B, K))
            take = sample_BK[:B]
            samples[rank, : take.shape[0]] = take + 1  # 0 = no sample
            pieces += [torch.from_numpy(load_E), torch.from_numpy(coact_EE.reshape(-1)),
                       torch.tensor([float(layer.stats.tokens)], dtype=torch.float64),
                       torch.from_numpy(samples.reshape(-1))]
            layer.stats.reset()
        flat = torch.cat([p.double() for p in pieces])
        if dist.is_initialized():
            dist.all_reduce(flat)
        out: list[LayerStats] = []
        offset = 0
        W = self.layers[0].topology.world_size
        for layer in self.layers:
            E, K = layer.num_experts, layer.stats.sample_BK.shape[1]
            sizes = [E, E * E, 1, world * B * K]
            load, coact, tokens, samples = flat[offset: offset + sum(sizes)].split(sizes)
            offset += sum(sizes)
            samples_RBK = samples.numpy().reshape(world, B, K).astype(np.int64) - 1
            keep_RB = samples_RBK[:, :, 0] >= 0
            src_RB = np.repeat((np.arange(world) % W)[:, None], B, axis=1)
            out.append(LayerStats(load.numpy().copy(), coact.numpy().reshape(E, E).copy(), int(tokens.item()),
                                  samples_RBK[keep_RB], src_RB[keep_RB]))
        return out

    def _start(self, engine: Any, step: int) -> None:
        stats = self._gather()
        self._apply_at = step + self.cfg.effective_apply_lag
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        currents = [layer.layout_slots.copy() for layer in self.layers]
        topo = self.layers[0].topology
        world = dist.get_world_size() if dist.is_initialized() else 1
        ep_groups = max(1, world // topo.world_size)
        self._result, self._error = None, None

        def work() -> None:
            try:
                self._result = [
                    plan_layer_decision(
                        st, cur, nodes=topo.nodes, gpus_per_node=topo.ranks_per_node, policy=self.cfg.policy,
                        redundant_slots=self.cfg.redundant_slots, seed=self.cfg.seed, link=self.link,
                        interval=self._interval, tokens_per_step=st.tokens / self._interval / ep_groups,
                        ignore_cost_model=self.mig.ignore_cost_model)
                    for st, cur in zip(stats, currents)]
            except Exception:  # noqa: BLE001 - a planner failure must not kill training
                self._error = traceback.format_exc()

        self._thread = threading.Thread(target=work, name=f"ds_cobalt-replan-{step}", daemon=True)
        self._thread.start()

    # ----- applying -----
    def _apply(self, engine: Any) -> None:
        self._apply_at = None
        L = len(self.layers)
        W = self.layers[0].topology.world_size
        S = self.layers[0].num_experts // W + self.cfg.redundant_slots
        payload = torch.full((L * (2 + W * S),), -1.0, dtype=torch.float64)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            if self._thread is not None:
                self._thread.join()
            self._thread = None
            if self._error is not None:
                logger.error(f"ds_cobalt replan failed, layout unchanged:\n{self._error}")
            for i, d in enumerate(self._result or []):
                if d.slots_WS.shape == (W, S):
                    payload[i] = d.action
                    payload[L + i] = d.saving_s
                    payload[2 * L + i * W * S: 2 * L + (i + 1) * W * S] = torch.from_numpy(
                        d.slots_WS.reshape(-1).astype(np.float64))
                else:
                    payload[i] = KEEP
            if not self._result:
                payload[:L] = KEEP
        if dist.is_initialized():
            dist.broadcast(payload, src=0)
        actions = payload[:L].long().tolist()
        savings = payload[L: 2 * L].tolist()
        slots = payload[2 * L:].numpy().astype(np.int64).reshape(L, W, S)
        to_migrate: list[np.ndarray | None] = [None] * L
        for i, (layer, action) in enumerate(zip(self.layers, actions)):
            if action == REPLICAS:
                layer.set_layout(slots[i])
            elif action == MIGRATE:
                to_migrate[i] = slots[i]
        if any(s is not None for s in to_migrate):
            saving = float(sum(s for s, a in zip(savings, actions) if a == MIGRATE))
            migrate(engine, to_migrate, reason=f"replan:{self.cfg.policy}", predicted_saving_s=saving,
                    asynchronous=self.mig.asynchronous)
        elif rank == 0:
            logger.info(f"ds_cobalt replan at step {engine.global_steps}: no owner migration "
                        f"({sum(a == REPLICAS for a in actions)} layer(s) changed replicas only)")
