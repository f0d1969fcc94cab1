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

Schedules (`transport.schedule`): `hierarchical` runs the exchange on the real topology (rail, then node);
`direct` runs the same exchange on a flat view of the EP group, every rank its own "node" (one exchange each
way over the whole group, each token once per destination rank); `dense` runs DeepSpeed's padded exchange, or the
layer class's own (`ExpertBinding.native_dense`: AutoEP's dropless one).
`auto`, after each layout change, lets the cost model (`schedule_model`) rule out what communication alone makes
slower, times the rest on the next steps (`StepTimedChoice`) and keeps the fastest; the choice is logged and
kept in `schedule`. Before the first trials a step hook may settle the layer on dense instead, where the model's
saving is small against the step (`settle_dense`, called by `integrations/schedule_gate.py`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..kernels import cupy_install_hint, resolve_backend
from ..planner.layout import contiguous_layout
from .comm import group_capacity
from .dense import dense_moe, expert_locations
from .dispatch import deepspeed_remote_routes
from .link_probe import probe_links
from .moe_exchange import OverlapSettings, bind, moe_exchange, slot_experts
from .placement import LayerPlacement, build_placement
from .replicas import ReplicaPlan, plan_replicas, plan_replicas_of
from .schedule_model import gather_routing, hardware_of, model_pruned, predict_comm_seconds
from .stats import DeviceRoutingStats
from .step_spares import BalanceCounters, NodeSpares, node_spares
from .tile_tuner import RAIL_CHUNK_CANDIDATES, OverlapTuner, StepTimedChoice
from .topology import EPGroups, Topology
from .traffic import ExchangeCounts, StepTraffic, TrafficCounters

# A piece of an expert's training state: a whole parameter (`row=None`) or one row of a fused tensor.
Piece = tuple[torch.nn.Parameter, "int | None"]

HIERARCHICAL, DIRECT, DENSE = "hierarchical", "direct", "dense"
# how much faster (fraction of a step) another schedule must measure to replace dense: about the spread of
# 3-step medians on the shared test machines (paired ratios moved by +-0.03)
DENSE_MARGIN = 0.05
# ... and this much where the cost model prices that schedule's communication no lower than dense's: it can then win
# only through the compute of dense's padding, which costs dense bytes too, so the model seldom misses such a case,
# while single steps in separate jobs here spread by +-20% (in one, hierarchical's trial median was 0.83x dense's
# and its re-timing ten steps later 1.27x)
DISPUTED_DENSE_MARGIN = 0.30
# the model must price a schedule's communication at least this much below dense's for DENSE_MARGIN to apply (else
# DISPUTED_DENSE_MARGIN): the close calls seen on fast links were priced within 2 % of dense (at loopback direct 1 %
# below it, and a 3-step median 7 % faster on noise kept it for the rest of a job), the clear wins at 100 Mbit/s
# 19-23 % (default model) and 53-70 % (fine-grained) below it
CLEAR_SAVING = 0.10
# a re-plan moves the owners of a layer whose cost model does not rule dense out only where its kept schedule
# measured this much faster than dense: layers kept on 5-9 % trial wins re-timed 9 % slower after their
# migration on fast links here (the owner moves, paid for, then ended on dense)
OWNER_MOVE_WIN = 0.15
# ... and where `ScheduleGate` declined the owner moves (the model's saving priced below its share of the step), a
# measured win this large overrules it: the model's link speed comes from a probe that read the 100 Mbit/s link at
# 1.25-1.86x its share in 5 of 28 probes here, and the default model's share there moved between 16-18 % and 25-27 %
# from job to job while its first trials measured hierarchical 28-46 % faster than dense; of the trial wins the gate
# was right to distrust (fine-grained model at 1 Gbit/s, steady steps 4-6 % apart) about 40 were 6-24 %, one 28 %,
# and the two of one job 34 % and 38 % (dense's median there 395 ms against DeepSpeed's 275)
DECLINE_OVERRULING_WIN = 0.30
# the model's clear favourite among the schedules other than dense (priced `CLEAR_SAVING` below the fastest) stays
# unless the fastest measures this much faster: with the fine-grained model at 1 Gbit/s the first trials' 3-step
# medians put direct 2-10 % ahead of hierarchical (priced 12 % below it) in 6 of 12 jobs, where side by side in one
# job direct ran at 0.944x DeepSpeed and hierarchical at 1.052x; at 100 Mbit/s a 2 % win took a layer to direct,
# whose steps then ran ~15 % slower
FAVOURITE_MARGIN = 0.15
# steps of the model's favourite before the schedule trials: the first steps of a run are slower than the next
# ones (at loopback here ~250, 200, 170 ms, then ~150), which would count against what runs in them
SCHEDULE_WARMUP = 3
# a schedule whose first timed step took more than this times the fastest one's is not timed again: beyond the
# spread of single steps here (+-15%), so what is dropped was slower; the model's favourite is kept whatever one
# step measured, and dense unless the model predicts it slower too
SCREEN_RATIO = 1.25
# ... and one (not dense) whose first step took more than this times the fastest's where the cost model, too,
# predicts it slower than the fastest: two independent signs agree (at loopback hierarchical and direct measure
# 1.1-1.2x dense and the model prices them higher, so their 4 more trial steps went)
AGREED_SCREEN_RATIO = 1.10
# dense, ruled out by the cost model for a layer's layout (predicted at least 2x the best), stays ruled out for the
# layer's next layouts while predicted at least this many times the best: its traffic does not depend on the layout,
# and the 2x line moves with the routing sample (at 100 Mbit/s one layer's prediction went from 2.6x to 1.96x). The
# verdict marks the layer's traffic as what its steps wait on (`traffic_bound`); dense is timed all the same
# (`StepTimedChoice.use_model` keeps the preferred candidate), so the measurement decides
RULED_OUT_HOLD_RATIO = 1.5
# tokens per rank whose routes the cost model counts rows on (scaled to the real token count): 512, fewer on
# large groups so the gathered sample stays within 8192 tokens
_MODEL_SAMPLE_TOKENS, _MODEL_SAMPLE_TOTAL = 512, 8192

# A child of DeepSpeed's logger (by name, no import): messages use its handlers and level.
_log = logging.getLogger("DeepSpeed").getChild("ds_cobalt")


@dataclass(frozen=True)
class _Phased:
    """Overlap settings of the direct schedule (always phased)."""

    enabled: bool = False
    tile_rows: int | str = "auto"
    rail_chunks: int | str = 1


NativeDense = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "dist.ProcessGroup | None"],
                       tuple[torch.Tensor, ExchangeCounts]]


@dataclass(frozen=True)
class ExpertBinding:
    """How this rank's experts compute: `module` applied with `names` bound to the tensors of one owner slot
    (`owner_tensors[s]`), or to a replica's fetched weights. `owner_modules[s]`, when given, is a module whose own
    parameters are `owner_tensors[s]` (one module per expert): called as it is, which costs less."""

    module: torch.nn.Module
    names: tuple[str, ...]
    owner_tensors: Sequence[tuple[torch.Tensor, ...]]
    owner_modules: Sequence[torch.nn.Module] | None = None
    # the layer class's own exchange, run as the `dense` schedule in place of DeepSpeed MoE's padded one (AutoEP's
    # dropless exchange): `(x_TD, topk_ids_TK, weights_TK, owner_block_E, ep_group) -> (out_TD, ExchangeCounts)`
    native_dense: NativeDense | None = None


class _Settings(Protocol):
    """What the core reads of the `"cobalt"` section (`ds_cobalt.config.CobaltConfig`)."""

    @property
    def overlap(self) -> OverlapSettings: ...

    @property
    def kernels(self) -> "_KernelSettings": ...

    @property
    def transport(self) -> "_TransportSettings": ...

    @property
    def planner(self) -> "_PlannerSettings": ...


class _PlannerSettings(Protocol):
    stage2: str


class _KernelSettings(Protocol):
    backend: str


class _TransportSettings(Protocol):
    schedule: str


def _clearly_faster(mode: str, timings_s: dict[str, float], than: str | None = None) -> bool:
    """Whether `mode` measured at least `DENSE_MARGIN` faster than `than` (default: every other mode timed beside
    it)."""
    others = [t for m, t in timings_s.items() if m != mode and than in (None, m)]
    return mode in timings_s and bool(others) and timings_s[mode] <= (1.0 - DENSE_MARGIN) * min(others)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread: a forward run then is a recomputation
    (activation checkpointing, reentrant or not), which must repeat the original forward's choices."""
    return torch._C._current_graph_task_id() != -1


def _lazy_recompute_active() -> bool:
    """Whether this forward runs under non-reentrant activation checkpointing (`torch.utils.checkpoint(...,
    use_reentrant=False)`, transformers' default gradient checkpointing), whose recomputation starts lazily from
    inside backward, wherever a saved tensor is first needed."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


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
        self.balance = BalanceCounters()  # per-GPU load of this node with and without stage 2 every step
        self.trace_rows: list[torch.Tensor] | None = None  # top-k ids per forward while a trace records
        self.trace_training_only = False  # ... of training forwards only (`cobalt.trace`), or of every forward
        self._owner = weakref.ref(owner)
        self._pieces = pieces
        self._groups: EPGroups | None = None
        self._flat_groups: EPGroups | None = None  # the direct schedule's view: every rank its own node
        self._placement: LayerPlacement | None = None
        self._flat_placement: LayerPlacement | None = None
        self._chooser: StepTimedChoice | None = None
        self._dense_capacities: set[int] = set()  # fixed capacities all ranks confirmed for `dense`
        self._replica_plan: ReplicaPlan | None = None
        self._spares: NodeSpares | None = None  # stage 2 every step (hierarchical schedule), None = off
        # the layout without its spare slots' replicas: (hierarchical, flat) placements, None without spare slots
        self._bare: tuple[LayerPlacement, LayerPlacement] | None = None
        # how the chosen schedule uses the spare slots (`replica_modes`), timed where several; None = the layout's
        self._replica_chooser: StepTimedChoice | None = None
        self._replica_schedule: str | None = None  # the schedule `_replica_chooser` times for
        self._device = device  # where the layer's weights are now (lookup tables follow them)
        self._backend: tuple[torch.device, str] | None = None  # (device, kernel backend resolved for it)
        # the last `auto` decision and dense's step seconds in it (None before one): a new layout re-times the kept
        # schedule, also when it comes while the previous re-timing is still running
        self._kept_schedule: str | None = None
        self._dense_seconds: float | None = None
        self._dense_ruled_out = False  # the model ruled dense out for the layout before (`RULED_OUT_HOLD_RATIO`)
        self._chooser_from_forward = 0  # forwards run before the current choice started
        self.layout_gain_material = True  # `ScheduleGate`: the model's saving matters to the step (after step 1)
        # `ScheduleGate` (after step 1): whether it judged the owner moves of a plan before the trials, and whether the
        # model's saving is large enough against the step for them (`schedule_gate.OWNER_MOVE_SHARE`)
        self.owner_moves_judged = False
        self.owner_moves_priced = False
        self.forwards = 0  # forward passes run (training and eval; a recomputation inside backward is not one)
        self._last_run: tuple[str, str | None] | None = None  # (schedule, replica mode) of the last forward
        self.schedule_forwards: Counter[str] = Counter()  # forwards run on each transport schedule
        # every `auto` decision: the forward it came in (1-based) and the same fields as `schedule_summary`
        self.schedule_history: list[dict] = []
        # every timed choice of `stage2` (how the spare slots are used): forward, schedule, mode, median step seconds
        self.replica_history: list[dict] = []

    # A core holds its layer weakly (the layer holds the core). Copies and pickles of the layer (`copy.deepcopy` of a
    # template block, `torch.save(model)`) carry the reference as a strong one, so the copy's core refers to the
    # copy, not to the layer it was copied from. The other callables (`pieces`, `device`) are the owner's bound
    # methods, which copy and pickle the same way.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_owner": self._owner()}

    def __setstate__(self, state: dict) -> None:
        owner = state.pop("_owner")
        self.__dict__.update(state)
        self._owner = weakref.ref(owner) if owner is not None else lambda: None

    # ----- groups and layout -----------------------------------------------------------------------
    def attach(self, groups: EPGroups) -> None:
        """Use `groups` and DeepSpeed's contiguous layout."""
        self._groups = groups
        topo = groups.topology
        self._flat_groups = EPGroups(Topology(topo.world_size, 1, topo.rank), groups.ep_ranks, groups.ep_group,
                                     groups.ep_group, None, groups.world_group)
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
        """The kernel backend the ops get, checked once per device: "torch", "cupy", or "auto" on CUDA with CuPy
        (each op then picks by its size, `kernels.auto_backend`)."""
        if self._backend is None or self._backend[0] != device:
            setting = self.settings.kernels.backend
            resolved = resolve_backend(setting, device=device)  # raises for an impossible choice
            if setting == "auto" and device.type == "cuda" and resolved == "torch" and self.topology.rank == 0:
                _log.warning("ds_cobalt kernels: CuPy does not import, so the torch kernels run (%s)",
                             cupy_install_hint())
            self._backend = (device, "auto" if setting == "auto" and resolved == "cupy" else resolved)
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
        previous_slots = None if self._placement is None else self._placement.slots_WS
        self._placement = build_placement(slots_WS, topo.ranks_per_node, self.num_experts, self._device())
        self._flat_placement = build_placement(slots_WS, 1, self.num_experts, self._device())
        self._replica_plan = plan_replicas(self._placement, topo.rank)
        self._spares = self._replica_chooser = self._replica_schedule = self._bare = None
        if self.settings.planner.stage2 != "interval" and topo.ranks_per_node > 1:
            self._spares = node_spares(slots_WS, topo.ranks_per_node, self.num_experts, topo.rank, self._device())
        P = self.num_local_experts
        if (slots_WS[:, P:] >= 0).any():
            bare_WS = slots_WS.copy()
            bare_WS[:, P:] = -1
            self._bare = (build_placement(bare_WS, topo.ranks_per_node, self.num_experts, self._device()),
                          build_placement(bare_WS, 1, self.num_experts, self._device()))
        elif slots_WS.shape[1] > P:  # spare slots, all empty: the layout itself
            self._bare = (self._placement, self._flat_placement)
        before = self._chooser
        previous = self._kept_schedule
        self._note_dense_ruled_out(before, previous)
        # dense sends the same padded blocks on any layout: its time measured for the layout before stands where the
        # kept schedule won clearly (`owners_may_move`); after a narrow win both are timed again, side by side, since
        # dense's time from the first trials (the slower first steps of a run) would favour what is timed later
        known = {DENSE: self._dense_seconds} if (previous not in (None, DENSE) and self._dense_seconds is not None
                                                 and self.owners_may_move) else {}
        # the layer's first trials start after SCHEDULE_WARMUP steps (the run's first steps are slower); trials for a
        # later layout (re-timing the kept schedule, or first trials restarted by a layout change) after one step
        warmup = SCHEDULE_WARMUP if before is None else 1
        # a re-timing against dense's earlier time keeps the schedule that won clearly unless dense measures faster by
        # the margin (`DISPUTED_DENSE_MARGIN` where the model priced dense above it): its trial steps can share their
        # step with another layer's dense trials, or follow a migration, and read slow (at 100 Mbit/s one re-timing
        # after a migration put hierarchical at dense's time, 0.361 against 0.363 s, after 0.24-0.31 s before)
        self._chooser = self._schedule_chooser(self._schedule_candidates(previous=previous), known, warmup,
                                               prefer=previous if known else DENSE)  # every layout
        self._chooser_from_forward = self.forwards
        if known and before is not None and before.predicted:
            # a re-timing against dense's earlier time runs no cost model: the last prediction sets its margin
            # (`CLEAR_SAVING`; for the layout before, which the kept schedule's traffic only gains on)
            self._chooser.predicted = dict(before.predicted)
        elif before is not None and before.predicted and np.array_equal(slots_WS, previous_slots):
            # the same layout again (trials restarted, `restart_trials`): the model's order and pruning stand
            self._chooser.use_model(before.predicted, before.pruned)

    def _note_dense_ruled_out(self, before: StepTimedChoice | None, previous: str | None) -> None:
        """Whether the model ruled dense out for the layout `before` was chosen on (`RULED_OUT_HOLD_RATIO`); a layout
        that came before that choice's model ran keeps the flag."""
        if previous in (None, DENSE):
            self._dense_ruled_out = False
        elif before is not None and before.predicted:
            self._dense_ruled_out = DENSE in before.pruned

    def _model_pruning(self, predicted: dict[str, float], fixed_s: float) -> list[str]:
        """The candidates the model rules out (`model_pruned`); dense also at `RULED_OUT_HOLD_RATIO` where it was
        ruled out for the layout before."""
        pruned = model_pruned(predicted, fixed_s)
        if self._dense_ruled_out and DENSE not in pruned and \
                DENSE in model_pruned(predicted, fixed_s, ratio=RULED_OUT_HOLD_RATIO):
            pruned.append(DENSE)
        return pruned

    @staticmethod
    def _schedule_chooser(candidates: list[str], known: dict[str, float] | None = None,
                          warmup: int = SCHEDULE_WARMUP, prefer: str = DENSE) -> StepTimedChoice:
        """Timed choice among `candidates`; DeepSpeed's own exchange (dense) stays unless another schedule
        measures `DENSE_MARGIN` faster, so noise in a close call does not make the layer slower than DeepSpeed.
        `known`: step seconds measured before, which need no trial. `prefer`: the schedule that stays in a close
        call (dense; in a re-timing against dense's known time, the schedule kept)."""
        return StepTimedChoice(candidates, warmup=warmup, prefer=prefer, margin=DENSE_MARGIN,
                               screen_ratio=SCREEN_RATIO, agreed_ratio=AGREED_SCREEN_RATIO, known=known,
                               disputed_margin=DISPUTED_DENSE_MARGIN, clear_saving=CLEAR_SAVING,
                               favourite_margin=FAVOURITE_MARGIN)

    def _schedule_candidates(self, without: tuple[str, ...] = (), previous: str | None = None) -> list[str]:
        """The schedules `auto` chooses from. After a layout change (`previous`: the schedule of the last decision,
        also when a re-timing for the layout before had not ended) only that one and dense are candidates: a new
        layout (placement, replicas) cuts what hierarchical and direct send alike, so it rarely changes which of
        the two is faster, and it does not change dense's traffic at all (a layer that kept dense keeps it,
        untimed; one that left it times both again after a narrow win, after a clear one the kept schedule against
        dense's earlier time, `install_layout`)."""
        wanted = self.settings.transport.schedule
        if wanted != "auto":
            return [HIERARCHICAL if wanted in without else wanted]
        topo = self.topology
        # with `overlap.enabled` the hierarchical candidate runs overlapped (or, with "auto", overlapped or phased,
        # whichever forward the tuner measures faster once hierarchical is kept): dense stays a candidate, so
        # turning overlap on never keeps a layer slower than DeepSpeed's exchange
        if topo.world_size == 1:
            # nothing to send: DeepSpeed's own computation is the least work (one H200, T=4096: dense 1.2x
            # DeepSpeed's layer time, hierarchical 1.8x; docs/kernels.md)
            candidates = [DENSE]
        elif topo.nodes == 1 or topo.ranks_per_node == 1:
            candidates = [HIERARCHICAL, DENSE]  # one stage: direct is hierarchical
        else:
            candidates = [HIERARCHICAL, DIRECT, DENSE]
        if previous in candidates:
            candidates = [c for c in candidates if c in (previous, DENSE)]
        return [c for c in candidates if c not in without]

    def _may_overlap(self) -> bool:
        """Whether this layer may run the overlapped schedule: overlap on, and hierarchical pinned or among
        `auto`'s candidates (checked in every forward, so an error about it comes in the first one)."""
        wanted = self.settings.transport.schedule
        return bool(self.settings.overlap.enabled) and (
            wanted == HIERARCHICAL or (wanted == "auto" and HIERARCHICAL in self._schedule_candidates()))

    def restart_trials(self) -> None:
        """Start `auto`'s first trials again on the current layout (one warm-up step). The replanner calls it for
        the layers a plan leaves as they are, when others take a new layout before their first choice: every
        layer's trials then run the same schedule in the same step, so no layer's trial steps carry another's."""
        if not self.first_schedule_chosen:
            self.install_layout(self.layout_slots)

    def retime_kept(self) -> bool:
        """Time the schedule kept against dense again, on the same layout: the replanner calls it for the layers it
        leaves out (`layout_settled`) at the re-plan steps that are multiples of the interval. Such a layer
        chose on its first trials, whose 3-step medians at 1 Gbit/s here put hierarchical and direct 10-16 % ahead of
        dense where their later steps ran 3-11 % behind DeepSpeed's in separate jobs; a re-plan's layout change used
        to re-time it, and without one nothing would. Dense is the preferred candidate (the kept schedule stays only
        where it measures `DENSE_MARGIN` faster); the last cost model stands (same layout). Whether it started (not
        on dense, nor before the first choice or during a trial)."""
        if self.settled_dense or not self.first_schedule_chosen or self.schedule is None:
            return False
        self.install_layout(self.layout_slots)
        return True

    def step_end(self) -> None:
        """Called after each optimizer step (`CobaltEngine.step`): closes a running schedule trial."""
        if self._chooser is not None:
            self._chooser.step_end(self._device())
        if self._replica_chooser is not None:
            self._replica_chooser.step_end(self._device())

    @property
    def schedule(self) -> str | None:
        """The schedule in use (None while `auto` is still timing the candidates)."""
        return None if self._chooser is None else self._chooser.chosen

    @property
    def first_schedule_chosen(self) -> bool:
        """Whether `auto` has made this layer's first choice (later layouts only re-time the schedule kept)."""
        return self._kept_schedule is not None

    @property
    def settled_dense(self) -> bool:
        """Whether this layer runs the dense schedule for its current layout (chosen, or the only one); re-plans
        leave such a layer out: its traffic is DeepSpeed's padded blocks on any layout."""
        return self.schedule == DENSE

    @property
    def owner_moves_declined(self) -> bool:
        """`ScheduleGate` judged this layer after step 1 and priced its schedules' saving over dense below
        `OWNER_MOVE_SHARE`: no owner moves, no plan before the trials, and after the first choice no re-plans; unless
        the last decision measured the kept schedule `DECLINE_OVERRULING_WIN` faster than dense (the measurement wins
        over the model)."""
        return self.owner_moves_judged and not self.owner_moves_priced and not self._measured_win(
            DECLINE_OVERRULING_WIN)

    def _measured_win(self, win: float) -> bool:
        """The last decision kept a schedule other than dense that measured at least `win` (a fraction of dense's
        step) faster than dense."""
        if not self.schedule_history:
            return False
        last = self.schedule_history[-1]
        timings, kept = last["timings_s"], last["schedule"]
        return kept != DENSE and kept in timings and DENSE in timings and timings[kept] <= (1.0 - win) * timings[DENSE]

    @property
    def layout_settled(self) -> bool:
        """Whether re-plans leave this layer out: it runs the dense schedule (`settled_dense`), or its first choice is
        made and `ScheduleGate` priced its schedules' saving over dense too small against the step for owner moves
        (`owners_may_move`): a plan could change only its spare slots, which restarts its re-timing for a share of
        a small saving (fine-grained model at 1 Gbit/s here: the re-plans after steps 13 and 25 changed only spare
        slots, steps 14-30 ran 0.6-0.7 s above DeepSpeed's in three of four 60-step jobs, and most such layers then
        settled on dense)."""
        return self.settled_dense or (self.first_schedule_chosen and self.owner_moves_declined)

    @property
    def expects_layout_gain(self) -> bool:
        """Before `auto`'s first choice for this layer: whether its cost model rules dense out, or prices a schedule
        whose traffic follows the layout (hierarchical, direct) at least `CLEAR_SAVING` below dense's and that saving
        is material to the step (`layout_gain_material`, set by `ScheduleGate` after step 1). The replanner then
        plans the layer before its trials start (`planner.plan_before_trials`), so they time the layout it will run,
        not the contiguous one. Where `ScheduleGate` judged the owner moves of that plan, only if it priced them
        (`owner_moves_priced`): a plan whose owners stay buys little before the trials and costs its worker's CPU
        beside the first steps."""
        chooser = self._chooser
        if chooser is None or self.first_schedule_chosen or not chooser.predicted:
            return False
        if self.owner_moves_declined:
            return False
        if DENSE in chooser.pruned:
            return True
        return self.layout_gain_material and any(
            c != DENSE and chooser.priced_below(c, DENSE, CLEAR_SAVING) for c in chooser.candidates)

    @property
    def dense_modelled(self) -> bool:
        """Before `auto`'s first choice: the cost model has priced dense and other candidates to time (dense ruled
        out or not)."""
        chooser = self._chooser
        return (not self.first_schedule_chosen and chooser is not None and DENSE in chooser.predicted
                and len(chooser.candidates) > 1)

    @property
    def dense_contested(self) -> bool:
        """Before `auto`'s first choice: the cost model has priced this layer's candidates, did not rule dense out
        (where it did, dense is timed all the same but the gate has nothing to weigh), and left dense among several
        to time."""
        return (self.dense_modelled and DENSE in self._chooser.candidates
                and DENSE not in self._chooser.pruned)

    @property
    def first_trials_due(self) -> bool:
        """`dense_contested`, and the warm-up steps are over: the next forward starts timing the candidates
        (`ScheduleGate` may settle the layer on dense first)."""
        return self.dense_contested and self._chooser.trials_due

    @property
    def warmup_step_s(self) -> float | None:
        """This rank's median warm-up window of the current choice (the layer's forward to the end of the
        optimizer step, of the candidate leading the trials), leaving out the run's first step where there are
        others; None before one."""
        windows = self._chooser.warmup_s if self._chooser is not None else []
        if self._chooser_from_forward == 0 and len(windows) > 1:
            windows = windows[1:]
        return float(np.median(windows)) if windows else None

    def predicted_dense_gaps(self) -> tuple[float, float]:
        """`(best, warm-up)`: the cost model's communication seconds of dense minus those of the best other
        candidate it kept, and minus those of the candidate that ran the warm-up steps (its favourite); for
        `first_trials_due` layers."""
        chooser = self._chooser
        predicted = chooser.predicted
        others = [predicted[c] for c in chooser.candidates if c != DENSE]
        favourite = chooser.candidates[0]
        return predicted[DENSE] - min(others), predicted[DENSE] - predicted[favourite]

    def warm_up_on_dense(self) -> None:
        """For a `dense_contested` layer in its first warm-up: dense runs the remaining warm-up steps and leads the
        trials (`ScheduleGate`, where the model's saving looks immaterial after step 1). The warm-up then times
        dense's own step, and a layer that settles on dense ran DeepSpeed's exchange, not the favourite's CPU
        work (direct at loopback here: ~250 ms steps against dense's ~150). Nothing changes where no warm-up step is
        left (`StepTimedChoice.lead_with`)."""
        if self._chooser.lead_with(DENSE):
            self._chooser_from_forward = self.forwards  # the windows now start after the run's first step

    def settle_dense(self, saving_share: float) -> None:
        """Make `auto`'s first choice dense without trials: the cost model's saving over dense, `saving_share` of a
        step, is too small for the trials to resolve or to repay them (`ScheduleGate`)."""
        before = self._chooser
        self._chooser = StepTimedChoice([DENSE])
        self._chooser.predicted, self._chooser.pruned = dict(before.predicted), list(before.pruned)
        self._kept_schedule, self._dense_seconds = DENSE, None
        self.schedule_history.append({"forward": self.forwards, "schedule": DENSE, "timings_s": {},
                                      "model": self.schedule_model, "untimed_saving_share": saving_share})

    # ----- auto's decisions across a checkpoint or a round trip to logical order ------------------------------
    def decision_state(self) -> dict:
        """What `auto` and `ScheduleGate` decided for this layer, as plain Python values (a checkpoint's client state,
        `integrations/checkpoint.py`): the schedule in use (None while one is timed), the one kept by the last
        decision, dense's step seconds in it, the gate's verdicts, the cost model's last input and both histories
        (their `forward` numbers count the forwards of the run that made them), and the overlap tuner's choices with
        the overlap settings they were made for (`"overlap"`)."""
        chooser = self._chooser
        overlap = self.settings.overlap
        return _plain({"transport_schedule": self.settings.transport.schedule, "schedule": self.schedule,
                "kept": self._kept_schedule, "dense_seconds": self._dense_seconds,
                "dense_ruled_out": self._dense_ruled_out, "layout_gain_material": self.layout_gain_material,
                "owner_moves_judged": self.owner_moves_judged, "owner_moves_priced": self.owner_moves_priced,
                "timings_s": self.schedule_timings,
                "predicted": {} if chooser is None else dict(chooser.predicted),
                "pruned": [] if chooser is None else list(chooser.pruned),
                "schedule_history": self.schedule_history, "replica_history": self.replica_history,
                "overlap": {"settings": {"enabled": overlap.enabled, "tile_rows": overlap.tile_rows,
                                         "rail_chunks": overlap.rail_chunks}, "chosen": self.tuner.chosen()}})

    def hold_decisions(self) -> tuple:
        """This layer's choosers as they are, for `reinstate_decisions` once the same layout is back (a round trip to
        logical order for a checkpoint or an export, between steps: no trial step is open)."""
        return (self._chooser, self._chooser_from_forward, self._replica_chooser, self._replica_schedule,
                self._kept_schedule, self._dense_seconds, self._dense_ruled_out)

    def reinstate_decisions(self, held: tuple) -> None:
        """Put back `hold_decisions()`: installing the layout again started a new choice, which the round trip does
        not call for (saving a checkpoint would otherwise re-time every layer not on dense)."""
        (self._chooser, self._chooser_from_forward, self._replica_chooser, self._replica_schedule,
         self._kept_schedule, self._dense_seconds, self._dense_ruled_out) = held

    def restore_decisions(self, state: dict) -> bool:
        """Continue from `decision_state()`, taken on this layer's topology and current layout (a checkpoint loaded
        with its layout, or the layout back after `logical_order`), as the run that took it would have: a schedule
        chosen then is used again untimed; where one was being timed against dense, that timing starts over on this
        layout; before the first choice the trials start over. How the spare slots are used is chosen again from
        the restored history (`_replica_mode`). Only where the run that saved and this one both use
        `transport.schedule: "auto"` (False, nothing of this changed, otherwise); ValueError naming the key where a
        schedule is not one this layer can run. The overlap tuner's choices come back under any schedule where the
        saving run had the same overlap settings (`restore_overlap_choices`)."""
        self.restore_overlap_choices(state.get("overlap"))
        if self.settings.transport.schedule != "auto" or state.get("transport_schedule") != "auto":
            return False
        # "overlap" came later: a checkpoint without it restores the rest
        missing = [key for key in self.decision_state() if key not in state and key != "overlap"]
        if missing:
            raise ValueError(f"ds_cobalt decisions: missing {missing}")
        allowed = self._schedule_candidates()
        for key in ("schedule", "kept"):
            if state.get(key) not in (None, *allowed):
                raise ValueError(f"ds_cobalt decisions: {key} {state[key]!r} is not a schedule this layer runs "
                                 f"({allowed})")
        self._dense_ruled_out = bool(state["dense_ruled_out"])
        self.layout_gain_material = bool(state["layout_gain_material"])
        self.owner_moves_judged = bool(state["owner_moves_judged"])
        self.owner_moves_priced = bool(state["owner_moves_priced"])
        self.schedule_history = [dict(h) for h in state["schedule_history"]]
        self.replica_history = [dict(h) for h in state["replica_history"]]
        self._kept_schedule, self._dense_seconds = state["kept"], state["dense_seconds"]
        if state["schedule"] is not None and self._kept_schedule is not None:
            chooser = StepTimedChoice([state["schedule"]])
            chooser.predicted, chooser.pruned = dict(state["predicted"]), list(state["pruned"])
            chooser.medians = dict(state["timings_s"])
            self._chooser, self._chooser_from_forward = chooser, self.forwards
            self._replica_chooser = self._replica_schedule = None
        else:  # the re-timing of the kept schedule, or the first trials, start over on this layout
            self.install_layout(self.layout_slots)
            if self._chooser.known and state["predicted"]:  # against dense's earlier time: the last model stands
                self._chooser.predicted = dict(state["predicted"])
        return True

    def restore_overlap_choices(self, saved: dict | None) -> bool:
        """Take the tile rows, rail chunks and overlapped-or-phased choice of `decision_state()["overlap"]` where the
        run that saved it had this run's overlap settings (else, or with nothing saved, False and the tuner times
        its trials again); a choice this run's tuner cannot make is a ValueError naming it."""
        overlap = self.settings.overlap
        current = {"enabled": overlap.enabled, "tile_rows": overlap.tile_rows, "rail_chunks": overlap.rail_chunks}
        if not saved or saved.get("settings") != _plain(current):
            return False
        chosen = saved.get("chosen") or {}
        parts = {"tile_rows": (self.tuner.tiles, None), "rail_chunks": (self.tuner.chunks, RAIL_CHUNK_CANDIDATES),
                 "overlap": (self.tuner.mode, (0, 1))}
        for key, value in chosen.items():
            if key not in parts:
                raise ValueError(f"ds_cobalt decisions: overlap choice {key!r} is not one of {sorted(parts)}")
            allowed = parts[key][1]
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and not (is_int and (value in allowed if allowed else value >= 1)):
                raise ValueError(f"ds_cobalt decisions: overlap {key} {value!r} is not a choice of this layer's tuner "
                                 f"({'a positive int' if allowed is None else allowed})")
        for key, value in chosen.items():
            if value is not None:
                parts[key][0].chosen = value
        return True

    @property
    def traffic_bound(self) -> bool:
        """The cost model found this layer's traffic material to its steps: it ruled dense out in the last decision
        (or, before one, in the current model), or `ScheduleGate` priced a saving over dense large enough against the
        step for owner moves (`owner_moves_priced`). The same on every rank (agreed inputs)."""
        if self.owner_moves_priced:
            return True
        if self.schedule_history:
            return DENSE in self.schedule_history[-1]["model"].get("pruned", ())
        return self._chooser is not None and DENSE in self._chooser.pruned

    @property
    def owners_may_move(self) -> bool:
        """Whether a re-plan may move this layer's owners: the schedule it runs follows the layout and clearly beats
        dense, which no layout helps. Before `auto`'s first choice: `ScheduleGate` priced the model's saving over
        dense large enough against the step (`owner_moves_priced`), or, without its verdict, the cost model rules
        dense out. After it: the last decision measured the kept schedule at least `OWNER_MOVE_WIN` faster than
        dense, or dense was not measured in it (a fixed schedule, or ranks with different fixed capacities); and
        where `ScheduleGate` judged the layer, it priced the owner moves too, or the win measured
        `DECLINE_OVERRULING_WIN`: a trial win against a saving the model
        put small against the step was not the steady one (fine-grained model at 1 Gbit/s here: the model's share
        10-14 %, first trials 15-24 % in favour of hierarchical, steady steps 4-6 %; in two of three jobs a layer
        whose owners moved after them, 27-52 experts, went back to dense). Elsewhere the layer takes a plan's spare
        slots only: a narrow win may not hold on the new layout, and owner moves that end on dense are paid for
        nothing."""
        chooser = self._chooser
        if self.owner_moves_declined:
            return False
        if not self.first_schedule_chosen:
            return self.owner_moves_judged or (chooser is not None and DENSE in chooser.pruned)
        last = self.schedule_history[-1]
        if last["schedule"] == DENSE or DENSE not in last["timings_s"]:
            return last["schedule"] != DENSE
        return self._measured_win(OWNER_MOVE_WIN)

    @property
    def stage2(self) -> str | None:
        """How the schedule in use fills the spare slots for this layout: "step" (stage 2, refilled every forward),
        "interval" (the re-plan's replicas), "none" (left unused: measured faster without replicas); None while
        `planner.stage2: "auto"` times them, or where there is nothing to choose."""
        return None if self._replica_chooser is None else self._replica_chooser.chosen

    def replica_modes(self, schedule: str) -> list[str]:
        """The ways `schedule` can fill this layout's spare slots (`stage2`), timed where several. Stage 2 every
        step refills them in the hierarchical schedule only; "none" is timed with `planner.stage2: "auto"`, since
        each replica costs a weight fetch and a gradient return every step, which on fast links can cost more
        than its traffic saves (fine-grained model at 1 Gbit/s: 1.04x DeepSpeed with one spare slot, 1.19x
        without, side by side). The overlapped schedule keeps the layout's replicas (with `overlap.enabled: "auto"`:
        where the tuner kept it)."""
        stage2 = self.settings.planner.stage2
        overlapped = schedule == HIERARCHICAL and (self.overlap_settings or {}).get("overlapped") is True
        if schedule == DENSE or self._bare is None or overlapped:
            return []
        filled = self._bare[0] is not self._placement
        modes = ["step"] if schedule == HIERARCHICAL and self._spares is not None else []
        if filled and stage2 != "step":
            modes.append("interval")
        if stage2 == "auto" and modes:
            modes.append("none")
        return modes

    @property
    def overlap_settings(self) -> dict | None:
        """With `overlap.enabled` on: what the hierarchical schedule runs with, `overlapped` (False: phased),
        `tile_rows` and `rail_chunks`, each the configured value or the tuner's choice (None while not chosen yet);
        else None."""
        overlap = self.settings.overlap
        if not overlap.enabled:
            return None
        chosen = self.tuner.chosen()
        mode = True if overlap.enabled is True else None if chosen["overlap"] is None else bool(chosen["overlap"])
        return {"overlapped": mode,
                "tile_rows": chosen["tile_rows"] if overlap.tile_rows == "auto" else overlap.tile_rows,
                "rail_chunks": chosen["rail_chunks"] if overlap.rail_chunks == "auto" else overlap.rail_chunks}

    @property
    def schedule_timings(self) -> dict[str, float]:
        """Median step seconds per candidate of the last `auto` decision (slowest rank; a candidate dropped after
        the first round: its one timed step), empty before one."""
        return {} if self._chooser is None else dict(self._chooser.medians)

    @property
    def schedule_model(self) -> dict:
        """The cost model's input to the current `auto` choice: `predicted` communication seconds per candidate
        (one layer, forward + backward) and the candidates it `pruned`; empty without a choice to make."""
        chooser = self._chooser
        if chooser is None or not chooser.predicted:
            return {}
        return {"predicted_comm_s": dict(chooser.predicted), "pruned": list(chooser.pruned)}

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
            deepspeed_capacity: torch.Tensor | int = 0, capacity_is_local: bool = False,
            locations_TK: torch.Tensor | None = None, training: bool = True) -> torch.Tensor:
        """`[T, D]` weighted expert outputs for the router's `topk_ids_TK` (int, -1 = dropped) and
        `weights_TK`. `training`: the layer's mode; an eval forward runs the schedule and replica mode chosen (or,
        during `auto`'s trials, the leading candidate) without timing anything, so evaluations between training
        steps do not count as trial steps, and adds nothing to the routing statistics (re-plans) nor to
        `cobalt.trace`'s trace (its traffic is counted; an explicit `start_trace` records every forward).
        `deepspeed_capacity`: C of DeepSpeed's padded E x C buffers (0 = none); `capacity_is_local`: it is this
        rank's value, DeepSpeed's is the largest over the EP group (the count exchange finds it,
        instead of the gate's all-reduce). `locations_TK`: each route's row in its expert's C rows (DeepSpeed's
        gate gives them; computed here otherwise), for the `dense` schedule."""
        topo = self.topology
        recompute = self._last_run is not None and _in_backward()
        if recompute:  # activation checkpointing: the last forward again, with its choices, timing and counting nothing
            schedule, replicas = self._last_run
        else:
            self.forwards += 1
            if self._chooser.wants_model:
                self._model_schedules(topk_ids_TK, x_TD.shape[1] * x_TD.element_size(), deepspeed_capacity,
                                      capacity_is_local or locations_TK is None, _expert_bytes(experts),
                                      native_dense=experts.native_dense is not None)
            schedule = self._pick_schedule(x_TD.device, timed=training)
        padded_by_deepspeed = True  # the router is DeepSpeed's, whose E x C buffers the counters compare with
        if schedule == DENSE and experts.native_dense is None:
            if locations_TK is None:  # a router without capacity buffers and no exchange of its own: dropless locations
                locations_TK, deepspeed_capacity = expert_locations(topk_ids_TK, self.num_experts)
                capacity_is_local, padded_by_deepspeed = True, False
            capacity = self._dense_group_capacity(deepspeed_capacity, capacity_is_local, x_TD.device)
            if capacity is None:  # ranks hold different fixed capacities: dense is out for this layout
                assert not recompute, "a recomputed forward sees the capacities of its forward"
                self._chooser = self._schedule_chooser(self._schedule_candidates(without=(DENSE,)))
                schedule = self._pick_schedule(x_TD.device, timed=training)
        flat = schedule in (DIRECT, DENSE)
        if self._may_overlap() and not recompute and _lazy_recompute_active():
            raise ValueError(
                f"cobalt.overlap.enabled={self.settings.overlap.enabled!r} does not work under non-reentrant "
                "activation checkpointing (torch.utils.checkpoint(..., use_reentrant=False), transformers' default "
                "gradient checkpointing): its recomputation would start inside the overlapped backward's exchanges "
                "at points that differ between ranks. Set cobalt.overlap.enabled to false, or checkpoint with "
                "use_reentrant=True (gradient_checkpointing_kwargs={'use_reentrant': True}, deepspeed.checkpointing)")
        groups = self._flat_groups if flat else self.groups
        placement = self._flat_placement if flat else self.placement
        if not recompute:
            self.schedule_forwards[schedule] += 1
            replicas = self._replica_mode(schedule, x_TD.device, timed=training)
            self._last_run = (schedule, replicas)
            if training:  # the routing of training steps only: evaluations would move plans and token counts
                # a layer that re-plans leave out needs no co-activation or samples (`layout_settled`)
                self.stats.update(topk_ids_TK, planned=not self.layout_settled)
            if self.trace_rows is not None and (training or not self.trace_training_only):
                self.trace_rows.append(topk_ids_TK.detach().cpu())
        if replicas == "none":
            placement = self._bare[1] if flat else self._bare[0]
        fetched: list[ReplicaPlan] = []  # the replica plan this forward fetched weights for (none: no fetch)
        if schedule == DENSE and experts.native_dense is not None:
            out_TD, counts = experts.native_dense(x_TD, topk_ids_TK, weights_TK, placement.owner_block_E,
                                                  groups.ep_group)
        elif schedule == DENSE:
            slots, _ = slot_experts(experts.module, experts.names, experts.owner_tensors, placement.slots_per_rank,
                                    None, groups, experts.owner_modules)
            out_TD, counts = dense_moe(x_TD, topk_ids_TK, locations_TK, weights_TK, placement, groups,
                                       [None if slot is None else bind(slot) for slot in slots], capacity,
                                       self.backend(x_TD.device))
            if not padded_by_deepspeed:  # the padding is ours: DeepSpeed's (AutoEP's) layer would pad nothing
                counts = replace(counts, deepspeed_capacity=0)
        else:
            layout_plan = None if replicas == "none" else self._replica_plan

            def slots_for(step_slots_WS: np.ndarray | None):
                plan = (layout_plan if step_slots_WS is None
                        else plan_replicas_of(step_slots_WS, self.num_experts, topo.rank))
                if plan is not None and placement.slots_per_rank > len(experts.owner_tensors):
                    fetched.append(plan)  # `slot_experts` fetches its replicas
                return slot_experts(experts.module, experts.names, experts.owner_tensors, placement.slots_per_rank,
                                    plan, groups, experts.owner_modules)

            out_TD, counts, fill = moe_exchange(x_TD, topk_ids_TK, weights_TK, placement, groups, slots_for,
                                                overlap=_Phased() if flat else self.settings.overlap,
                                                tuner=self.tuner, backend=self.backend(x_TD.device),
                                                capacity=(deepspeed_capacity, capacity_is_local),
                                                spares=self._spares if replicas == "step" else None,
                                                replay=recompute,
                                                # the overlap tuner times forwards once the schedule is kept: trial
                                                # steps of `auto` run its settings so far (else its guesses)
                                                tune=training and self._chooser.chosen is not None)
            if fill is not None and not recompute:
                self.balance.add(fill)
        row_bytes = x_TD.shape[1] * x_TD.element_size()
        G = topo.ranks_per_node
        rail_nodes = [p // G for p in range(topo.world_size)] if flat else list(range(topo.nodes))
        self.traffic.add(StepTraffic.measure(
            counts, row_bytes=row_bytes, topology=topo, experts_per_rank=placement.owner_slots_per_rank,
            rail_peer_node=rail_nodes, rail_self=topo.rank if flat else topo.node,
            node_self=0 if flat else topo.local_rank,
            replica_rows=(fetched[-1].send_splits, fetched[-1].recv_splits) if fetched else ((), ()),
            expert_bytes=_expert_bytes(experts) if fetched else 0))
        self.traffic.add_deepspeed_routes(deepspeed_remote_routes(topk_ids_TK, self.num_experts, topo), row_bytes)
        return out_TD

    def _model_schedules(self, topk_ids_TK: torch.Tensor, row_bytes: int, capacity: torch.Tensor | int,
                         dropless: bool, expert_bytes: int, native_dense: bool = False) -> None:
        """Orders and prunes the `auto` candidates with the cost model (`schedule_model`), once per layout:
        one link probe (cached), one all-gather of sampled routes and of each rank's dense capacity.
        `expert_bytes`: one expert's weights (what each replica fetches); `native_dense`: dense is the layer
        class's own dropless exchange (`ExpertBinding.native_dense`), one row per route, not padded buffers."""
        groups = self.groups
        start = time.perf_counter()
        costs = probe_links(groups, topk_ids_TK.device)
        probed = time.perf_counter()
        # dense's C: the largest (rank, expert) count where dropless (the gate's, or AutoEP's), else the fixed one
        local = expert_locations(topk_ids_TK, self.num_experts)[1] if dropless else capacity
        per_rank = max(16, min(_MODEL_SAMPLE_TOKENS, _MODEL_SAMPLE_TOTAL // self.topology.world_size))
        topk, src, scale, capacity_W = gather_routing(topk_ids_TK, groups, per_rank, local)
        predicted = predict_comm_seconds(self._chooser.candidates, topk, src, scale, self.layout_slots,
                                         self.topology.ranks_per_node, self.num_experts, int(capacity_W.max()),
                                         row_bytes, hardware_of(costs, self.topology.ranks_per_node), dropless,
                                         expert_bytes, native_dense=native_dense)
        self._chooser.use_model(predicted, self._model_pruning(predicted, costs.fixed_s))
        if self.topology.rank == 0:
            _log.info("ds_cobalt transport: cost model in %.2f s (link probe %.2f s, cached after the first layer)",
                      time.perf_counter() - start, probed - start)

    def _replica_mode(self, schedule: str, device: torch.device, timed: bool = True) -> str | None:
        """This forward's use of the spare slots (`stage2`; None: the layout's replicas). While `auto` still times
        the schedules, the hierarchical trials run with stage 2 on; once the schedule is decided its modes
        (`replica_modes`) are timed on the next steps, again after every layout change (not `timed`: an eval
        forward, which takes the mode chosen or the leading one and times nothing)."""
        if self._chooser.chosen is None:
            return "step" if "step" in self.replica_modes(schedule) else None
        if schedule == HIERARCHICAL and (self.overlap_settings or {}).get("overlapped", False) is None:
            return None  # the overlap tuner's forward trials first: which modes there are depends on its choice
        if self._replica_schedule != schedule:
            modes = self.replica_modes(schedule)
            last = next((h for h in reversed(self.replica_history) if h["schedule"] == schedule), None)
            kept = None if last is None else last["stage2"]
            if "none" in modes and last is not None and _clearly_faster("none", last["timings_s"]):
                # replicas measured clearly slower for this schedule before: what they cost every step (a weight fetch
                # and a gradient return per spare slot) does not depend on the layout, so a new one is not timed
                # again. A narrow win of "none" (or one it kept by preference) is: what replicas save does depend on
                # the layout (at 100 Mbit/s a layer that kept "none" on a 4 % loss of the re-plan's replicas sent
                # ~0.7 MB more a step for the rest of a 60-step job, 1.56x DeepSpeed against 1.63-1.68x)
                modes = ["none"]
            elif (self.traffic_bound and kept in modes and kept != "none"
                  and _clearly_faster(kept, last["timings_s"], than="none")):
                # the replicas measured clearly faster than none where the layer's traffic is what its steps wait on:
                # the next re-plan chooses them again to cut that traffic, so a new layout keeps the mode untimed (at
                # 100 Mbit/s each re-timing ran three steps of "none", 40-55 ms and ~0.8 MB slower each)
                modes = [kept]
            # no replicas stays unless another mode measures DENSE_MARGIN faster: it runs fewer collectives, and a
            # 3-step median here once kept the re-plan's replicas where side by side they cost 13 % of a step. Where
            # the layer's traffic is what its steps wait on (`traffic_bound`), the replicas, which cut that traffic,
            # stay instead unless "none" measures DENSE_MARGIN faster: at 100 Mbit/s they saved ~7 % of a step, which
            # 3-step medians put at 2-4 % (or below "none")
            prefer = next((m for m in modes if m != "none"), "none") if self.traffic_bound else "none"
            self._replica_chooser = (StepTimedChoice(modes, prefer=prefer, margin=DENSE_MARGIN) if modes else None)
            self._replica_schedule = schedule
        chooser = self._replica_chooser
        if chooser is None:
            return None
        decided = chooser.chosen is not None
        if not timed:
            return chooser.untimed_pick()
        mode = chooser.pick(device, self.groups)
        if not decided and chooser.chosen is not None and len(chooser.candidates) > 1:
            self.replica_history.append({"forward": self.forwards, "schedule": schedule, "stage2": chooser.chosen,
                                         "timings_s": dict(chooser.medians)})
            if self.topology.rank == 0:
                _log.info("ds_cobalt replicas (%s schedule): chose %s (median step seconds %s)", schedule,
                          chooser.chosen, {c: round(t, 5) for c, t in chooser.medians.items()})
        return mode

    def _pick_schedule(self, device: torch.device, timed: bool = True) -> str:
        chooser = self._chooser
        if not timed:  # an eval forward: no trial step
            return chooser.untimed_pick()
        decided = chooser.chosen is not None
        schedule = chooser.pick(device, self.groups)
        newly_decided = not decided and chooser.chosen is not None
        # a chooser may start decided (one candidate, or only known times): its choice is kept all the same
        if newly_decided or (decided and chooser.chosen != self._kept_schedule):
            self._kept_schedule = chooser.chosen
            self._dense_seconds = chooser.medians.get(DENSE, self._dense_seconds)
            entry = {"forward": self.forwards, "schedule": chooser.chosen, "timings_s": self.schedule_timings,
                     "model": self.schedule_model}
            if chooser.sequence:  # this rank's timed steps in the order run (the decision: medians, slowest rank)
                entry["trial_steps"] = [[c, t] for c, t in chooser.sequence]
            self.schedule_history.append(entry)
        if newly_decided and self.topology.rank == 0:
            _log.info("ds_cobalt transport: chose the %s schedule (median step seconds %s, dropped after one timed "
                      "step: %s; model's communication seconds %s, ruled out by it: %s)", chooser.chosen,
                      {c: round(t, 5) for c, t in chooser.medians.items()}, list(chooser.screened) or "none",
                      {c: round(t, 5) for c, t in chooser.predicted.items()}, chooser.pruned or "none")
        return schedule

    def _dense_group_capacity(self, capacity: torch.Tensor | int, is_local: bool, device: torch.device) -> int | None:
        """C for the dense schedule. A dropless capacity is reduced over the group every forward; a fixed one
        (`drop_tokens=True`) must be the same on every rank, as DeepSpeed's layer needs: each new value is
        checked by one all-reduce (ranks see new values together: train/eval capacity factors), None = the
        ranks differ."""
        if is_local:
            return group_capacity(capacity, True, self.groups.ep_group, device)
        value = int(torch.as_tensor(capacity).item())  # NOTE: host sync (buffer sizes)
        if value not in self._dense_capacities:
            both = torch.tensor([value, -value], dtype=torch.int64, device=device)
            if self.groups.ep_group is not None:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.groups.ep_group)
            high, low = both.tolist()  # NOTE: host sync, once per capacity value
            if high != -low:
                _log.warning("ds_cobalt transport: ranks hold different capacities (%d..%d); the dense schedule "
                             "needs one, it is left out for this layout", -low, high)
                return None
            self._dense_capacities.add(value)
        return value


def _plain(value):
    """A copy of `value` (dicts, lists, tuples, numbers, strings) with numpy scalars as Python numbers and tuples as
    lists: a checkpoint's client state then loads with torch's weights-only unpickler too."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


def _expert_bytes(experts: ExpertBinding) -> int:
    """Bytes of one expert's weights (a replica fetches them)."""
    return sum(t.numel() * t.element_size() for t in experts.owner_tensors[0])
