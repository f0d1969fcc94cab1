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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import logger

from ..config import CobaltConfig
from ..planner import LinkModel, assign_tasks, canonical_owner_order, migration_worth_it, plan_layer
from ..planner.layout import Layout
from ..planner.policies import LayerInput
from ..planner.stats import RoutingStats, merge_sets, topk_sets
from ..planner.assign import remote_nodes_per_token
from .expert_state import piece_numel
from .migration import migratable_layers, migrate

KEEP, REPLICAS, MIGRATE = 0, 1, 2


@dataclass(frozen=True)
class LayerStats:
    """Routing statistics of one layer over one interval, summed over all ranks."""

    load_E: np.ndarray
    coact_EE: np.ndarray
    tokens: int
    samples_TK: np.ndarray  # [T, K] recent top-k rows, -1 = dropped
    source_rank_T: np.ndarray  # [T] EP rank each sample came from


@dataclass(frozen=True)
class LayerDecision:
    action: int  # KEEP, REPLICAS or MIGRATE
    slots_WS: np.ndarray
    old_cross: float = 0.0
    new_cross: float = 0.0
    saving_s: float = 0.0  # modelled saving over the interval, migration time subtracted


def align_owner_slots(current_WS: np.ndarray, new_WS: np.ndarray, per_rank: int) -> np.ndarray:
    """`new_WS` with each rank's owners reordered so experts that stay on a rank keep their slot."""
    out = np.array(new_WS, dtype=np.int64, copy=True)
    for r in range(out.shape[0]):
        wanted = [int(e) for e in new_WS[r, :per_rank]]
        row = [-1] * per_rank
        for i, e in enumerate(current_WS[r, :per_rank]):
            if int(e) in wanted:
                row[i] = int(e)
        rest = iter(e for e in wanted if e not in row)
        out[r, :per_rank] = [e if e >= 0 else next(rest) for e in row]
    return out


def cross_node_per_token(samples_TK: np.ndarray, source_rank_T: np.ndarray, slots_WS: np.ndarray,
                         gpus_per_node: int) -> float:
    if samples_TK.shape[0] == 0:
        return 0.0
    dest, _ = assign_tasks(samples_TK, source_rank_T, slots_WS, gpus_per_node)
    return float(remote_nodes_per_token(dest, source_rank_T, gpus_per_node).mean())


def plan_layer_decision(stats: LayerStats, current_WS: np.ndarray, *, nodes: int, gpus_per_node: int,
                        policy: str, redundant_slots: int, seed: int, link: LinkModel, interval: int,
                        tokens_per_step: float, ignore_cost_model: bool) -> LayerDecision:
    """Pure: what to do with one layer. Owners move only when the cost model says it pays."""
    E = stats.load_E.size
    W = nodes * gpus_per_node
    P = E // W
    valid = stats.samples_TK[stats.samples_TK[:, 0] >= 0] if stats.samples_TK.size else stats.samples_TK
    sets_MK, count_M = merge_sets(topk_sets(valid), np.ones(valid.shape[0]))
    routing = RoutingStats(E, stats.samples_TK.shape[1], decay=0.0, load_E=stats.load_E, coact_EE=stats.coact_EE,
                           sets_MK=sets_MK, count_M=count_M)
    # Step 1: the policy's layout, owners first, owners that stay on a rank in their current slot.
    inp = LayerInput(stats=routing, topk_ids_TK=stats.samples_TK, source_rank_T=stats.source_rank_T,
                     nodes=nodes, gpus_per_node=gpus_per_node, redundant_slots=redundant_slots,
                     current_slots_WS=current_WS, seed=seed)
    slots = plan_layer(policy, inp)
    slots = canonical_owner_order(Layout(E, nodes, gpus_per_node, slots[None])).layer(0)
    slots = align_owner_slots(current_WS, slots, P)
    # Step 2: same owners -> only replicas change (free); else ask the cost model.
    if np.array_equal(slots[:, :P], current_WS[:, :P]):
        same = slots.shape == current_WS.shape and np.array_equal(slots, current_WS)
        return LayerDecision(KEEP if same else REPLICAS, slots)
    old = cross_node_per_token(stats.samples_TK, stats.source_rank_T, current_WS, gpus_per_node)
    new = cross_node_per_token(stats.samples_TK, stats.source_rank_T, slots, gpus_per_node)
    old_rank = np.empty(E, np.int64)
    old_rank[current_WS[:, :P].reshape(-1)] = np.repeat(np.arange(W), P)
    new_rank = np.empty(E, np.int64)
    new_rank[slots[:, :P].reshape(-1)] = np.repeat(np.arange(W), P)
    moved = int((old_rank != new_rank).sum())
    bytes_per_s = link.inter_node_gbps * 1e9 / 8
    saved_s = (old - new) * tokens_per_step * link.token_bytes * 4 * interval / bytes_per_s
    cost_s = moved * link.expert_bytes / bytes_per_s
    worth = migration_worth_it(moved, old, new, int(tokens_per_step), interval, link)
    if not (worth or (ignore_cost_model and moved)):
        return LayerDecision(KEEP, current_WS, old, new, saved_s - cost_s)
    return LayerDecision(MIGRATE, slots, old, new, saved_s - cost_s)


class Replanner:
    """The step hook. One instance per engine; see the module docstring for the timeline."""

    def __init__(self, engine: Any, cobalt: CobaltConfig) -> None:
        self.layers: list[Any] = migratable_layers(engine)
        self.cfg = cobalt.planner
        self.mig = cobalt.migration
        self._thread: threading.Thread | None = None
        self._result: list[LayerDecision] | None = None
        self._error: str | None = None
        self._apply_at: int | None = None
        self._interval = self.cfg.replan_interval
        if not self.layers:
            return
        first = self.layers[0]
        pieces = first.expert_state_pieces(0)
        elem = pieces[0][0].element_size()
        expert_params = sum(piece_numel(piece) for piece in pieces)
        self.link = LinkModel(expert_params=expert_params, weight_bytes_per_param=elem,
                              optimizer_bytes_per_param=12, token_bytes=elem * first.model_dim,
                              inter_node_gbps=self.mig.inter_node_gbps, margin=self.mig.margin)

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
