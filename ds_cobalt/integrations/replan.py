"""Online stage-1 replanning: statistics -> planner (worker processes, layers spread over ranks) -> migration.

Legend: L ds_cobalt layers, E experts, K top-k, W EP ranks, S slots per rank, P = E / W owner slots,
B sample rows per rank and layer, R world ranks.

Timeline (every rank runs the same hook after each optimizer step, so decisions line up without extra
per-step collectives):
- after step s in `planner.early_replan_steps` (first_replan_step, then the halvings of the interval after it)
  or with s % replan_interval == 0 (`is_plan_step`; while `auto` still makes a layer's first choice, or a plan is
  in flight, at the first step after s where neither holds): one all_reduce (sum) of every layer's load,
  co-activation,
  token count and up to B recent top-k rows per rank; statistics reset; rank r hands layers r, r + R, ...
  to its planner worker process (`plan_workers.py`), which runs at a lower CPU priority.
- after step 1 (`planner.plan_before_trials`), while `auto` still makes the layers' first schedule choices: the
  same for the layers whose cost model expects a schedule that gains from the layout
  (`LayerCore.expects_layout_gain`), applied after step min(1 + apply_lag, SCHEDULE_WARMUP), before their trials
  start (a layout change restarts them; the layers it leaves as they are restart theirs in the same step, so all
  layers' trials stay in step).
- after step s + apply_lag: each rank waits at most `plan_timeout_s` for its worker; one all_reduce (sum)
  of the per-layer decisions, each filled in by the one rank that planned it, gives every rank all of them;
  every rank applies them (replica-only changes with `set_layout`, owner changes with `migrate`). A layer
  whose worker failed, died or overran arrives empty and keeps its layout on every rank (logged; the worker
  is restarted and the layer planned again at the next interval), so ranks never diverge and never wait
  past the deadline.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import logger

from ..config import CobaltConfig
from ..planner import LinkModel
from ..planner.decisions import (
    KEEP,
    MIGRATE,
    REPLICAS,
    Confirmation,
    LayerDecision,
    LayerStats,
    confirm_on_newer_routing,
    plan_layer_decision,
)
from ..planner.policies import check_topology
from ..runtime.comm import all_reduce_host
from ..runtime.layer import SCHEDULE_WARMUP, LayerCore
from ..runtime.link_probe import probe_links
from ..runtime.placement import build_placement, remote_nodes_per_token
from .expert_state import piece_numel
from .layers import job_group
from .migration import flush_pending, migratable_layers, migrate
from .plan_workers import LayerPlanner, ThreadPlanner, WorkerUnavailable, make_planner

# The pure decision lives in the planner; these names stay importable from here.
__all__ = ["Replanner", "KEEP", "REPLICAS", "MIGRATE", "LayerStats", "LayerDecision", "plan_layer_decision"]


WORKER_LEAD_STEPS = 10  # a planner not running (stopped, or not started with the engine) starts this many steps early
# the step after which the plan before `auto`'s trials runs: the cost model has priced every layer's schedules in
# step 1's forward, and its layout can be applied before the trials start after step SCHEDULE_WARMUP
BEFORE_TRIALS_STEP = 1


def _remote_nodes(layer: LayerCore, slots_WS: np.ndarray, samples_TK: np.ndarray, source_T: np.ndarray) -> np.ndarray:
    """`[T]` the distinct remote nodes each sample token goes to under `slots_WS`, by the runtime's own task
    assignment (torch, in the training process: the planner's compiled kernels live in the worker)."""
    placement = build_placement(slots_WS, layer.topology.ranks_per_node, layer.num_experts)
    rows_TK = torch.from_numpy(samples_TK)
    out_T = np.zeros(len(source_T), dtype=np.int64)
    for src in np.unique(source_T):
        mine = source_T == src
        out_T[mine] = remote_nodes_per_token(rows_TK[torch.from_numpy(mine)], placement, int(src)).numpy()
    return out_T


def _plan_shape(layer: LayerCore) -> tuple[int, int, int, int]:
    """What a re-plan's layers share: experts, EP size, ranks per node, model width."""
    topo = layer.topology
    return layer.num_experts, topo.world_size, topo.ranks_per_node, layer.model_dim


class Replanner:
    """The step hook. One instance per engine; see the module docstring for the timeline."""

    def __init__(self, engine: Any, cobalt: CobaltConfig) -> None:
        every = migratable_layers(engine)
        # the layers planned share one shape (a plan's request, payload and link model are per shape): the most
        # common among those with several EP ranks, ties to the first (every rank sees the same layers)
        shapes = [_plan_shape(layer) for layer in every]
        spread = [shape for shape in shapes if shape[1] > 1] or shapes
        planned = max(spread, key=lambda shape: (spread.count(shape), -spread.index(shape))) if spread else None
        self._positions = [i for i, shape in enumerate(shapes) if shape == planned]
        self.layers: list[LayerCore] = [every[i] for i in self._positions]
        self._all_layers = len(every)
        left = sorted(set(range(len(every))) - set(self._positions))
        if left and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(f"ds_cobalt: re-planning covers the MoE layers with {planned[0]} experts, EP size "
                           f"{planned[1]}, {planned[2]} ranks per node and model width {planned[3]}; layers {left} "
                           "differ and keep their layout")
        self.cfg = cobalt.planner
        self.mig = cobalt.migration
        self._planner: LayerPlanner | None = None
        self._submit_error: str | None = None
        self._start_error: str | None = None  # why this rank's planner did not start (None: it did or was not due)
        self._pending: tuple | None = None  # this rank's request in flight (kept for checkpoints)
        self._skipped: list[int] = []  # layers left out of the plan in flight (dense schedule)
        self._owners_stay: list[int] = []  # layers of the plan in flight that take its spare slots only
        self._start_s: dict[str, float] = {}  # the last `_start`: its step, this rank's gather and submit seconds
        self.history: list[dict[str, Any]] = []  # per re-plan: step, layers planned / in all, slowest share (s)
        self._apply_at: int | None = None
        self._interval = self.cfg.replan_interval
        self._early = self.cfg.early_replan_steps  # the plan steps before the first multiple of the interval
        self.dense_skips: list[int] = []  # steps whose re-plan was skipped: every layer `layout_settled`
        self.deferred: list[tuple[int, int]] = []  # (plan step, step the re-plan started or was skipped): it waited
        self._deferred_from: int | None = None  # a plan step whose re-plan waits (schedule trials, plan in flight)
        # the step after which the layers' routing statistics were last read and reset (None: not known, resumed)
        self.stats_since_step: int | None = 0
        if not self.layers:
            return
        _check_redundant_slots(self.layers[0], self.cfg.redundant_slots)
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
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._mine = list(range(rank, len(self.layers), world))  # this rank's share of the layers
        self._start_planner_with_engine()

    def _start_planner_with_engine(self) -> None:
        """Start this rank's planner now and wait until it is ready: its imports and numba kernels take ~2 s of
        CPU, which beside training (where the ranks fill the cores) slowed the steps around it by up to 1.5 s and
        skewed `auto`'s trials. A job whose layers all run the dense schedule plans nothing and starts none."""
        if self._all_settled():
            return
        t0 = time.perf_counter()
        self._ensure_planner()
        if self._planner is None:
            return
        try:
            not_started = self._planner.wait_ready()
        except WorkerUnavailable as e:
            self._plan_in_threads(e)
            return
        if not_started is not None:
            logger.warning(f"ds_cobalt: {not_started} (started again at the next re-plan)")
        elif not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(f"ds_cobalt: planner worker ready ({time.perf_counter() - t0:.1f} s)")

    def is_plan_step(self, step: int) -> bool:
        """Whether a re-plan starts after optimizer step `step` (a function of the step alone, so a resumed
        run plans at the same steps)."""
        return step > 0 and (step in self._early or step % self._interval == 0)

    def _next_plan_step(self, step: int) -> int:
        """The first plan step at or after `step`."""
        multiple = max(1, -(-step // self._interval)) * self._interval
        return min([s for s in self._early if s >= step] + [multiple])

    def _steps_since_last_plan(self, step: int) -> int:
        """Optimizer steps whose statistics a re-plan after `step` sums (since they were last read or reset; after
        a resume from a checkpoint that does not say, since the plan step before `step`)."""
        since = self.stats_since_step
        if since is None:
            since = max([s for s in self._early if s < step] + [(step - 1) // self._interval * self._interval])
        return max(1, step - since)

    def _all_settled(self) -> bool:
        """Every layer is one that re-plans leave out (`LayerCore.layout_settled`; unless the cost model is off)."""
        return not self.mig.ignore_cost_model and all(layer.layout_settled for layer in self.layers)

    def _schedules_chosen(self) -> bool:
        """Every layer has its schedule for the current layout (`auto`'s trials are over)."""
        return all(layer.schedule is not None for layer in self.layers)

    def _first_choices_made(self) -> bool:
        """`auto` has made every layer's first choice (after a layout change it only re-times the kept schedule)."""
        return all(layer.first_schedule_chosen for layer in self.layers)

    def _ensure_planner(self) -> None:
        """Start this rank's planner (a rank with no layer to plan starts none). A start that fails (the OS
        refusing a process, say) is logged once and tried again at the next call; a re-plan without a planner
        reports the error from `_apply`, so every rank still runs the same collectives."""
        if self._planner is not None or not self._mine:
            return
        try:
            self._planner = make_planner(self.cfg.worker, self.cfg.policy, logger.warning)
            self._start_error = None
        except Exception as e:  # noqa: BLE001 - no planner this interval; the layers keep their layout
            error = f"the planner worker did not start: {type(e).__name__}: {e}"
            if error != self._start_error:
                logger.warning(f"ds_cobalt: {error} (tried again before the next re-plan)")
            self._start_error = error

    def close(self) -> None:
        """Stop the planner worker (the engine's `destroy`; a worker also dies with its rank)."""
        if self._planner is not None:
            self._planner.close()
            self._planner = None

    def __call__(self, engine: Any) -> None:
        if not self.layers:
            return
        step = int(engine.global_steps)
        plan_due = self.is_plan_step(step) or self._deferred_from is not None
        if self._apply_at is None and self._all_settled():
            # nothing to plan: no worker, no gather, no collective (every rank sees the same schedules)
            self.close()  # the idle worker's memory (a layout change that ends `dense` starts another)
            if plan_due:
                self._end_deferral(step)  # a re-plan that waited for `auto`, which settled every layer on dense
                self.dense_skips.append(step)
                for layer in self.layers:  # the next re-plan sums the steps since this one, as after a plan
                    layer.stats.reset()
                self.stats_since_step = step
                if len(self.dense_skips) == 1 and (not dist.is_initialized() or dist.get_rank() == 0):
                    logger.info(f"ds_cobalt replan at step {step}: every layer runs the dense schedule (traffic "
                                "independent of the layout) or one whose saving over it is small against the step "
                                "(`LayerCore.layout_settled`); re-plans are skipped while they do")
                if step % self._interval == 0:
                    self._retime_kept(step)
            return
        if self._next_plan_step(step) - step <= min(self._interval, WORKER_LEAD_STEPS) and self._schedules_chosen():
            # a planner that did not start with the engine, or was stopped: a few steps early, so its imports and
            # kernels load meanwhile; not while `auto` still times the schedules, whose trials it would skew
            self._ensure_planner()
        if self._apply_at is not None and step >= self._apply_at:
            self._apply(engine)
        if self._plan_before_trials(engine, step):
            if plan_due and self._deferred_from is None:  # a re-plan due now waits as for any plan in flight
                self._deferred_from = step
            return
        if not plan_due:
            return
        waited = 0 if self._deferred_from is None else step - self._deferred_from
        if self._apply_at is not None or (not self._first_choices_made() and waited < self._interval):
            # a plan is in flight, or `auto` still makes a layer's first choice (one that settles on dense needs no
            # plan, and a layout change would restart its trials): the re-plan starts once neither holds, or after
            # an interval at most (migrations asked for by the user can keep restarting the trials)
            if self._deferred_from is None:
                self._deferred_from = step
            return
        due = self._end_deferral(step)
        if due is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(f"ds_cobalt replan due after step {due} starts after step {step} (it waited for `auto`'s "
                        "first schedule choices or for the plan in flight)")
        self._start(engine, step)
        if self.cfg.effective_apply_lag == 0:
            self._apply(engine)

    def _retime_kept(self, step: int, among: list[int] | None = None) -> None:
        """At a re-plan step that is a multiple of the interval, the layers left out (`among`; default: all, where the
        re-plan is skipped) and not on dense time their kept schedule against dense again (`LayerCore.retime_kept`),
        all in the same steps (every rank sees the same schedules, so all agree)."""
        among = range(len(self.layers)) if among is None else among
        retimed = [i for i in among if self.layers[i].retime_kept()]
        if retimed and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(f"ds_cobalt replan at step {step}: layers {retimed} time their schedule against dense again "
                        "(no plan: `LayerCore.layout_settled`)")

    def _plan_before_trials(self, engine: Any, step: int) -> bool:
        """Start the plan before `auto`'s trials where it is due after `step` (module docstring); whether it started.
        Every rank sees the same predictions (computed from gathered routes), so all agree."""
        if (step != BEFORE_TRIALS_STEP or not self.cfg.plan_before_trials or self._apply_at is not None
                or self._first_choices_made()):
            return False
        skipped = [i for i, layer in enumerate(self.layers) if not layer.expects_layout_gain]
        if len(skipped) == len(self.layers):
            return False
        self._start(engine, step, skipped=skipped, apply_lag=min(self.cfg.effective_apply_lag, SCHEDULE_WARMUP - step))
        if self._apply_at == step:
            self._apply(engine)
        return True

    def _end_deferral(self, step: int) -> int | None:
        """The plan step whose re-plan waited and now starts, or is skipped, after `step` (listed in `deferred`);
        None where nothing waited."""
        due, self._deferred_from = self._deferred_from, None
        if due is not None:
            self.deferred.append((due, step))
        return due

    # ----- statistics and planning -----
    def _gather(self) -> list[LayerStats]:
        """One all_reduce over the world: summed load/co-activation/tokens and every rank's samples."""
        pieces: list[torch.Tensor] = []
        for layer in self.layers:
            load_E, coact_EE, sample_BK = layer.stats.snapshot(self.cfg.sample_tokens)
            pieces += [torch.from_numpy(load_E), torch.from_numpy(coact_EE.reshape(-1)),
                       torch.tensor([float(layer.stats.tokens)], dtype=torch.float64), self._rows_piece(sample_BK)]
            layer.stats.reset()
        flat = torch.cat([p.double() for p in pieces])
        if dist.is_initialized():
            flat = all_reduce_host(flat, group=job_group(self.layers))
        out: list[LayerStats] = []
        offset = 0
        for layer in self.layers:
            E = layer.num_experts
            sizes = [E, E * E, 1, self._rows_piece_size(layer)]
            load, coact, tokens, samples = flat[offset: offset + sum(sizes)].split(sizes)
            offset += sum(sizes)
            out.append(LayerStats(load.numpy().copy(), coact.numpy().reshape(E, E).copy(), int(tokens.item()),
                                  *self._rows_of(samples, layer)))
        return out

    def _rows_piece(self, sample_BK: np.ndarray) -> torch.Tensor:
        """This rank's latest (at most B) top-k rows of a layer at its place in a [world, B, K] block (ids + 2, so
        a dropped route, -1, is 1 and 0 is no row): summed over the ranks, the block holds everyone's."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        B = self.cfg.sample_tokens
        samples = np.zeros((world, B, sample_BK.shape[1]))
        take = sample_BK[:B]
        samples[rank, : take.shape[0]] = take + 2
        return torch.from_numpy(samples.reshape(-1))

    def _rows_piece_size(self, layer: LayerCore) -> int:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return world * self.cfg.sample_tokens * layer.stats.sample_BK.shape[1]

    def _confirms(self, step: int) -> bool:
        """Whether the decisions applied after `step` are confirmed on the rows routed since the plan's sample
        (`planner.confirm_on_newer_routing`; not where the user overrides the cost model, nor without newer
        steps). A function of the config and the step, so every rank agrees."""
        since = self.stats_since_step
        return (self.cfg.confirm_on_newer_routing and not self.mig.ignore_cost_model and since is not None
                and step > since)

    def _rows_of(self, block: torch.Tensor, layer: LayerCore) -> tuple[np.ndarray, np.ndarray]:
        """`(samples_TK, source_rank_T)`: the rows of a summed `_rows_piece` block and the EP rank each came from."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        B, K, W = self.cfg.sample_tokens, layer.stats.sample_BK.shape[1], layer.topology.world_size
        samples_RBK = block.numpy().reshape(world, B, K).astype(np.int64) - 2
        keep_RB = samples_RBK[:, :, 0] >= -1  # a row (its first route may be dropped: -1)
        src_RB = np.repeat((np.arange(world) % W)[:, None], B, axis=1)
        return samples_RBK[keep_RB], src_RB[keep_RB]

    def _start(self, engine: Any, step: int, skipped: list[int] | None = None, apply_lag: int | None = None) -> None:
        """Gather the statistics and hand this rank's layers (all but `skipped`; default: those on the dense
        schedule) to its planner, to be applied `apply_lag` steps later (default `planner.apply_lag`). The layers
        whose owners may not move (`LayerCore.owners_may_move`: owner moves bet on a schedule that clearly beats
        dense, which no layout helps) then take a migration's owners-stay alternative (its spare slots) instead."""
        # a migration applied at this step commits in the next forward: the plan starts from its owners, or a
        # replica-only decision would keep the owners it replaces (collective, like the apply)
        flush_pending(engine)
        t0 = time.perf_counter()
        steps = self._steps_since_last_plan(step)  # the steps the statistics sum (before they count from here)
        stats = self._gather()
        self.stats_since_step = step  # the statistics now count from here
        self._start_s = {"planned_after_step": step, "gather_s": time.perf_counter() - t0,
                         "before_trials": skipped is not None}
        self._apply_at = step + (self.cfg.effective_apply_lag if apply_lag is None else apply_lag)
        world = dist.get_world_size() if dist.is_initialized() else 1
        topo = self.layers[0].topology
        ep_groups = max(1, world // topo.world_size)
        # A layer on the dense schedule sends DeepSpeed's padded blocks whatever the layout: a new one saves
        # nothing and would only restart `auto`'s timing; nor does one whose saving over dense is small against the
        # step (`LayerCore.layout_settled`). (All ranks agree on each layer's schedule and verdicts.)
        if skipped is None:
            skipped = [] if self.mig.ignore_cost_model else [
                i for i, layer in enumerate(self.layers) if layer.layout_settled]
        self._skipped = skipped
        self._owners_stay = self._owners_staying(skipped)
        mine = [i for i in self._mine if i not in self._skipped]
        params = {"nodes": topo.nodes, "gpus_per_node": topo.ranks_per_node, "policy": self.cfg.policy,
                  "redundant_slots": self.cfg.redundant_slots, "seed": self.cfg.seed, "interval": self._interval,
                  "ignore_cost_model": self.mig.ignore_cost_model, "link": asdict(self.link)}
        self._ensure_planner()
        if self._planner is None:  # no layer of this rank to plan, or its planner did not start
            self._submit_error = self._start_error
            return
        t0 = time.perf_counter()
        request = (f"{step}", mine, [stats[i] for i in mine], [self.layers[i].layout_slots.copy() for i in mine],
                   [stats[i].tokens / steps / ep_groups for i in mine], params)
        self._submit(request)
        self._start_s["submit_s"] = time.perf_counter() - t0

    def _owners_staying(self, skipped: list[int]) -> list[int]:
        """The planned layers whose owners stay (`LayerCore.owners_may_move`); none where the user overrides the
        cost model. Every rank sees the same schedules and timings (agreed through all-reduces), so all agree."""
        if self.mig.ignore_cost_model:
            return []
        return [i for i, layer in enumerate(self.layers) if i not in skipped and not layer.owners_may_move]

    def _submit(self, request: tuple) -> None:
        self._pending, self._submit_error = request, None
        assert self._planner is not None
        try:
            self._planner.submit(*request)
        except WorkerUnavailable as e:
            self._plan_in_threads(e).submit(*request)
        except Exception as e:  # noqa: BLE001 - no plan this interval; the next one tries again
            self._submit_error = f"{type(e).__name__}: {e}"

    def _plan_in_threads(self, why: WorkerUnavailable) -> LayerPlanner:
        logger.warning(f"ds_cobalt: the planner worker cannot plan policy {self.cfg.policy!r} ({why}); "
                       "planning runs in a thread of each rank from now on")
        if self._planner is not None:
            self._planner.close()
        self._planner = ThreadPlanner()
        return self._planner

    def _collect(self, request: tuple | None) -> tuple[dict[int, LayerDecision], float, str | None]:
        """This rank's decisions for `request` (empty, with the error, where its planner failed)."""
        assert self._planner is not None
        try:
            return self._planner.collect(self.cfg.plan_timeout_s)
        except WorkerUnavailable as e:  # found out only now (`submit` does not wait for the start): plan here
            if request is None:
                raise
            planner = self._plan_in_threads(e)
            planner.submit(*request)
            return planner.collect(self.cfg.plan_timeout_s)

    # ----- applying -----
    def _apply(self, engine: Any) -> None:
        """One all_reduce of every rank's share of the decisions; see the module docstring."""
        request, self._apply_at, self._pending = self._pending, None, None
        L = len(self.layers)
        W = self.layers[0].topology.world_size
        S = self.layers[0].num_experts // W + self.cfg.redundant_slots
        t0 = time.perf_counter()
        decisions, seconds, error = {}, 0.0, self._submit_error
        if self._planner is not None and error is None:
            try:
                decisions, seconds, error = self._collect(request)
            except Exception:  # noqa: BLE001 - this rank's layers keep their layout; the all_reduce still runs
                decisions, seconds, error = {}, 0.0, traceback.format_exc()
                self.close()  # a fresh planner at the next re-plan
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if error is not None:
            logger.error(f"ds_cobalt replan on rank {rank} failed, layers {self._mine} keep their layout "
                         f"(planned again at the next interval):\n{error}")
        # per layer: planned (1/0), action, saving_s, planning seconds, tokens per step, has a fallback (1/0), then
        # W * S slots and W * S fallback slots (a migration's owners-stay alternative)
        head = 6
        payload = torch.zeros((L, head + 2 * W * S), dtype=torch.float64)
        tokens_per_step = dict(zip(request[1], request[4])) if request is not None else {}
        for i, d in decisions.items():
            fallback = d.fallback_WS is not None and d.fallback_WS.shape == (W, S)
            if d.action == KEEP or d.slots_WS.shape == (W, S):  # KEEP carries the current slots, of any width
                payload[i, :head] = torch.tensor([1.0, d.action, d.saving_s, seconds, tokens_per_step.get(i, 0.0),
                                                  float(fallback)], dtype=torch.float64)
            if d.action != KEEP and d.slots_WS.shape == (W, S):
                payload[i, head: head + W * S] = torch.from_numpy(d.slots_WS.reshape(-1).astype(np.float64))
                if fallback:
                    payload[i, head + W * S:] = torch.from_numpy(d.fallback_WS.reshape(-1).astype(np.float64))
        # the rows routed since the plan's sample, to confirm its decisions on (in the same all_reduce)
        confirm = self._confirms(int(engine.global_steps))
        flat = torch.cat([payload.reshape(-1)] + ([self._rows_piece(layer.stats.recent_rows(self.cfg.sample_tokens))
                                                   for layer in self.layers] if confirm else []))
        if dist.is_initialized():
            flat = all_reduce_host(flat, group=job_group(self.layers))
        payload = flat[: payload.numel()].reshape(payload.shape)
        planned = payload[:, 0] > 0
        actions = torch.where(planned, payload[:, 1], float(KEEP)).long().tolist()
        savings = payload[:, 2].tolist()
        slots = payload[:, head: head + W * S].numpy().astype(np.int64).reshape(L, W, S)
        fallbacks = payload[:, head + W * S:].numpy().astype(np.int64).reshape(L, W, S)
        missing = [i for i in range(L) if not planned[i] and i not in self._skipped]
        slowest = float(payload[:, 3].max())
        unconfirmed = self._confirm(flat[payload.numel():], payload, actions, slots, fallbacks) if confirm else {}
        owners_held = self._hold_owners(payload, actions, slots, fallbacks)
        self.history.append({"step": int(engine.global_steps), "planned": int(planned.sum()), "layers": L,
                             "dense_skipped": list(self._skipped), "slowest_share_s": slowest,
                             "unconfirmed": sorted(unconfirmed), "owners_held": owners_held, **self._start_s,
                             "collect_s": time.perf_counter() - t0})
        if rank == 0:
            logger.info(f"ds_cobalt replan at step {engine.global_steps}: {int(planned.sum())} of {L} layer(s) "
                        f"planned on {min(world, L)} rank(s), slowest share {slowest:.2f} s"
                        + (f"; layers {missing} keep their layout" if missing else "")
                        + (f"; layers {self._skipped} keep theirs ("
                           + ("before the schedule trials: their cost model expects no gain from a layout)"
                              if self._start_s.get("before_trials") else
                              "they run the dense schedule, or their saving over it is small against the step: "
                              "`LayerCore.layout_settled`)")
                           if self._skipped else ""))
            if owners_held:
                logger.info(f"ds_cobalt replan at step {engine.global_steps}: layers {owners_held} change only their "
                            "spare slots (their cost model does not rule dense out, which no layout helps, and their "
                            "schedule has not measured clearly faster than it: `LayerCore.owners_may_move`)")
            for i, check in unconfirmed.items():
                kept = "changes only its spare slots" if actions[i] == REPLICAS else "keeps its layout"
                logger.info(f"ds_cobalt replan at step {engine.global_steps}: layer {i} {kept}; its plan does not "
                            f"hold on the routing since its sample (remote nodes per token {check.old_cross:.3f} "
                            f"now, {check.new_cross:.3f} planned, gain at its lower bound {check.gain_low:.3f})")
        to_migrate: list[np.ndarray | None] = [None] * L
        realign = self._start_s.get("before_trials") and any(a != KEEP for a in actions)
        for i, (layer, action) in enumerate(zip(self.layers, actions)):
            P = layer.num_local_experts
            if action == REPLICAS and not np.array_equal(slots[i][:, :P], layer.layout_slots[:, :P]):
                # planned on owners that a failed migration kept, or that another migration moved since (every rank
                # holds the same layouts, so all skip it)
                logger.warning(f"ds_cobalt replan at step {engine.global_steps}: layer {i}'s replica plan is for "
                               "other owners than it has now; it keeps its layout")
            elif action == REPLICAS:
                layer.set_layout(slots[i])
            elif action == MIGRATE:
                to_migrate[i] = slots[i]
            elif realign:
                layer.restart_trials()  # in step with the layers whose new layout restarts their trials
        planned_after = self._start_s.get("planned_after_step")
        if not self._start_s.get("before_trials") and planned_after and planned_after % self._interval == 0:
            # the left-out layers re-time as where every layer is left out, in step with the planned layers'
            # re-timings on their new layouts (a layer on dense does not)
            self._retime_kept(int(engine.global_steps), [i for i in self._skipped if i < L])
        if any(s is not None for s in to_migrate):
            saving = float(sum(s for s, a in zip(savings, actions) if a == MIGRATE))
            every: list[np.ndarray | None] = [None] * self._all_layers  # migrate() takes every ds_cobalt layer
            for position, slots_WS in zip(self._positions, to_migrate):
                every[position] = slots_WS
            migrate(engine, every, reason=f"replan:{self.cfg.policy}", predicted_saving_s=saving,
                    asynchronous=self.mig.asynchronous)
        elif rank == 0:
            logger.info(f"ds_cobalt replan at step {engine.global_steps}: no owner migration "
                        f"({sum(a == REPLICAS for a in actions)} layer(s) changed replicas only)")

    def _hold_owners(self, payload: torch.Tensor, actions: list[int], slots: np.ndarray,
                     fallbacks: np.ndarray) -> list[int]:
        """The migrations of `owners_stay` layers replaced by their owners-stay alternative (spare slots only), or
        by no change without one. Updates `actions` and `slots` in place; returns those layers."""
        held = [i for i in self._owners_stay if actions[i] == MIGRATE]
        for i in held:
            if payload[i, 5] > 0:
                actions[i], slots[i] = REPLICAS, fallbacks[i]
            else:
                actions[i] = KEEP
        return held

    def _confirm(self, rows: torch.Tensor, payload: torch.Tensor, actions: list[int], slots: np.ndarray,
                 fallbacks: np.ndarray) -> dict[int, Confirmation]:
        """Check the gathered decisions on the summed `_rows_piece` blocks `rows` (the rows routed since the plan's
        sample); an unconfirmed layer keeps its layout, or takes its migration's owners-stay fallback where that
        is no worse on the rows. Updates `actions` and `slots` in place; returns the unconfirmed checks."""
        unconfirmed: dict[int, Confirmation] = {}
        blocks = rows.split([self._rows_piece_size(layer) for layer in self.layers])
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            if actions[i] == KEEP:
                continue
            samples_TK, source_T = self._rows_of(block, layer)
            if not len(source_T):
                continue
            old_T = _remote_nodes(layer, layer.layout_slots, samples_TK, source_T)
            common = dict(num_experts=layer.num_experts, link=self.link, interval=self._interval,
                          tokens_per_step=float(payload[i, 4]), gpus_per_node=layer.topology.ranks_per_node)
            check = confirm_on_newer_routing(actions[i], slots[i], layer.layout_slots, old_T,
                                             _remote_nodes(layer, slots[i], samples_TK, source_T), **common)
            if check.action != KEEP:
                continue
            unconfirmed[i], actions[i] = check, KEEP
            if payload[i, 5] > 0 and not np.array_equal(fallbacks[i], layer.layout_slots) and \
                    confirm_on_newer_routing(REPLICAS, fallbacks[i], layer.layout_slots, old_T,
                                             _remote_nodes(layer, fallbacks[i], samples_TK, source_T),
                                             **common).action == REPLICAS:
                actions[i], slots[i] = REPLICAS, fallbacks[i]
        return unconfirmed

    # ----- checkpoints: what an exact resume needs (integrations/replan_state.py writes it) -----
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """This rank's statistics since the last re-plan and its plan in flight, as tensors and metadata."""
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            st = layer.stats
            tensors |= {f"stats.{i}.load_E": st.load_E, f"stats.{i}.coact_EE": st.coact_EE,
                        f"stats.{i}.sample_BK": st.sample_BK, f"stats.{i}.tokens": torch.tensor([st.tokens]),
                        f"stats.{i}.sampled": torch.tensor([st.sampled])}
        def text(value: int | None) -> str:
            return "" if value is None else str(value)

        meta = {"apply_at": text(self._apply_at), "pending": "", "skipped": json.dumps(self._skipped),
                "owners_stay": json.dumps(self._owners_stay),
                "stats_since_step": text(self.stats_since_step), "deferred_from": text(self._deferred_from)}
        if self._pending is not None:
            tag, ids, stats, currents, tokens_per_step, params = self._pending
            meta |= {"pending": tag, "params": json.dumps(params), "pending_layers": json.dumps(ids)}
            tensors["pending.tokens_per_step"] = torch.tensor(tokens_per_step, dtype=torch.float64)
            for lid, st, cur in zip(ids, stats, currents):
                tensors |= {f"pending.{lid}.{name}": torch.from_numpy(np.ascontiguousarray(value)) for name, value in
                            (("load_E", st.load_E), ("coact_EE", st.coact_EE), ("samples_TK", st.samples_TK),
                             ("source_rank_T", st.source_rank_T), ("current_WS", cur),
                             ("tokens", np.array([st.tokens])))}
        return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """The inverse of `state` (same world size and layers); a plan that was in flight is submitted again
        (planning is deterministic, so it yields the same decisions at the same step)."""
        for i, layer in enumerate(self.layers):
            st = layer.stats
            for name in ("load_E", "coact_EE", "sample_BK"):
                getattr(st, name).copy_(tensors[f"stats.{i}.{name}"])
            st.tokens = int(tensors[f"stats.{i}.tokens"].item())
            # (a checkpoint from before the count: every counted token was sampled)
            st.sampled = int(tensors[f"stats.{i}.sampled"].item()) if f"stats.{i}.sampled" in tensors else st.tokens
        self._apply_at = int(meta["apply_at"]) if meta.get("apply_at") else None
        self.stats_since_step = int(meta["stats_since_step"]) if meta.get("stats_since_step") else None
        self._deferred_from = int(meta["deferred_from"]) if meta.get("deferred_from") else None
        self._pending, self._skipped = None, json.loads(meta.get("skipped") or "[]")
        self._owners_stay = json.loads(meta.get("owners_stay") or "[]")
        if meta.get("pending") and self._mine:
            self._ensure_planner()
            if self._planner is None:
                self._submit_error = self._start_error
                return
            ids = json.loads(meta["pending_layers"])
            t = {name: value.numpy() for name, value in tensors.items() if name.startswith("pending.")}
            stats = [LayerStats(t[f"pending.{i}.load_E"], t[f"pending.{i}.coact_EE"], int(t[f"pending.{i}.tokens"][0]),
                                t[f"pending.{i}.samples_TK"], t[f"pending.{i}.source_rank_T"]) for i in ids]
            self._submit((meta["pending"], ids, stats, [t[f"pending.{i}.current_WS"] for i in ids],
                          t["pending.tokens_per_step"].tolist(), json.loads(meta["params"])))


def _check_redundant_slots(layer: LayerCore, redundant_slots: int) -> None:
    """ValueError naming `cobalt.planner.redundant_slots` where a rank cannot hold that many experts besides its
    own (a one-rank group plans nothing)."""
    topo = layer.topology
    if topo.world_size > 1:
        try:
            check_topology(layer.num_experts, topo.nodes, topo.ranks_per_node, redundant_slots)
        except ValueError as e:
            raise ValueError(f"cobalt.planner.redundant_slots={redundant_slots} does not fit this model: {e}") from None
