"""Migration: move expert owners between EP ranks together with their training state, all or nothing.

Legend: E experts, W EP ranks, S slots per rank, P = E / W owner slots per rank, F floats in one expert row.

Every rank owns P experts in every layer, so a new layout is a permutation of owner slots. An expert that
changes (rank, slot) travels as one fp32 row holding, per piece (a parameter of `ds_cobalt.MoE`'s expert
module, or one row of each of an AutoEP layer's fused tensors): the model weight, the fp32 master copy, the
optimizer moments (e.g. Adam `exp_avg`, `exp_avg_sq`) and, where the optimizer keeps one per parameter, its
`step`. `expert_state.py` reads and writes them (DeepSpeed's tensor-fragment API under ZeRO-1/2 and its
bf16 optimizer; the unfused optimizer's fp32 copies for bf16/fp16 without ZeRO; the torch optimizer state
for fp32 without ZeRO).

Two phases: (1) read the rows of moving experts, all-to-all them over the EP group into a staging buffer
(nothing is written); (2) one all_reduce confirms success on every rank, then each rank writes the staged
rows into its owner parameters and installs the new lookup tables. A failure in phase 1 on any rank
(an exception, a collective timeout, an injected fault) leaves the old layout and every bit of state as it
was, and is logged. `migrate(..., asynchronous=True)` (what the replanner uses with
`cobalt.migration.asynchronous`) starts the transfers right after the step and commits each layer in its
forward pre-hook, so a layer waits only for its own experts; see `PendingMigration`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import logger

from ..planner.owner_moves import OwnerMoves, plan_owner_moves
from ..runtime.comm import all_reduce_host, all_to_all_rows
from ..runtime.layer import LayerCore
from ..runtime.placement import build_placement
from .expert_state import ExpertStateIO, relink_optimizer_state
from .layers import job_group, layer_cores

__all__ = ["OwnerMoves", "MigrationReport", "PendingMigration", "plan_owner_moves", "migrate", "flush_pending",
           "relink_optimizer_state", "set_fault_hook", "ExpertStateIO", "migratable_layers", "moe_layers"]

# fault_hook(stage, layer_index) is called on every rank at "pack" (rows read), "transfer" (before the
# all-to-all) and "stage" (rows received); raising there simulates a failure on that rank.
FaultHook = Callable[[str, int], None]
_FAULT_HOOK: FaultHook | None = None


def set_fault_hook(hook: FaultHook | None) -> None:
    """Install (or clear with None) a process-wide fault-injection hook for tests."""
    global _FAULT_HOOK
    _FAULT_HOOK = hook


# ----------------------------------------------------------------------------------------- migration
@dataclass(frozen=True)
class MigrationReport:
    ok: bool
    step: int
    reason: str
    moved: tuple[tuple[int, int, int, int], ...]  # (layer, expert, old EP rank, new EP rank)
    bytes_moved: int  # bytes crossing ranks, whole EP group
    bytes_sent: int  # bytes this rank sent to other ranks
    seconds: float
    predicted_saving_s: float | None = None
    error: str | None = None  # this rank's error, if it failed here


def migratable_layers(engine: Any) -> list[LayerCore]:
    """The `LayerCore` of every ds_cobalt layer of an engine, in module order (`ds_cobalt.MoE` and converted
    AutoEP layers): what migration, checkpoints and the replanner work on."""
    return layer_cores(engine)


moe_layers = migratable_layers  # the name before AutoEP layers migrated too


def _plan_layers(engine: Any,
                 new_slots: Sequence[np.ndarray | None]) -> list[tuple[int, LayerCore, np.ndarray, OwnerMoves]]:
    """Validate the layouts (ValueError before any communication) and plan each layer's owner moves."""
    layers = migratable_layers(engine)
    if len(new_slots) != len(layers):
        raise ValueError(f"migrate: got {len(new_slots)} layouts for {len(layers)} ds_cobalt layers")
    plans = []
    for index, (layer, slots) in enumerate(zip(layers, new_slots)):
        if slots is None:
            continue
        slots = np.asarray(slots, dtype=np.int64)
        topo = layer.topology
        if slots.ndim != 2 or slots.shape[0] != topo.world_size:
            raise ValueError(f"migrate: layer {index} slots must be [{topo.world_size}, S], got {list(slots.shape)}")
        build_placement(slots, topo.ranks_per_node, layer.num_experts)  # validates owners
        moves = plan_owner_moves(layer.layout_slots, slots, layer.num_local_experts, topo.rank)
        plans.append((index, layer, slots, moves))
    return plans


def _read_rows(io: ExpertStateIO, layer: LayerCore, moves: OwnerMoves) -> torch.Tensor:
    """Phase 1 for one layer: the moving experts' rows, read only. Reads of ZeRO fragments are collectives
    of the expert-data-parallel group; they run in the same order on every rank."""
    pieces = layer.expert_state_pieces(0)
    if not moves.send_slot:
        return torch.zeros((0, io.row_size(pieces)), dtype=torch.float32, device=pieces[0][0].device)
    return io.read_rows([layer.expert_state_pieces(slot) for slot in moves.send_slot])


def _write_rows(io: ExpertStateIO, layer: LayerCore, moves: OwnerMoves, recv: torch.Tensor) -> None:
    io.write_rows([layer.expert_state_pieces(slot) for slot in moves.recv_slot], recv)


def _traffic(io: ExpertStateIO, layer: LayerCore, moves: OwnerMoves) -> tuple[int, int]:
    row_bytes = io.row_size(layer.expert_state_pieces(0)) * 4
    rank = layer.topology.rank
    return (row_bytes * (sum(moves.send_splits) - moves.send_splits[rank]),
            row_bytes * sum(1 for _, a, b in moves.moved if a != b))


def migrate(engine: Any, new_slots: Sequence[np.ndarray | None], *, reason: str = "forced",
            predicted_saving_s: float | None = None, fault_hook: FaultHook | None = None,
            asynchronous: bool = False) -> "MigrationReport | PendingMigration":
    """Move the owners of every ds_cobalt layer of `engine` to `new_slots[l]` (`[W, S]`, None = keep).

    Collective over the world group: every rank calls it with the same layouts, between optimizer
    steps. Returns the report (also logged, written to the DeepSpeed monitor and appended to
    `engine.cobalt_migrations`). ValueError for an invalid layout (before any communication).
    `asynchronous=True` returns a `PendingMigration` instead: the transfers run behind the next forward
    and each layer commits in a forward pre-hook, waiting only for its own experts.
    """
    if not getattr(engine, "commits_pending_migrations", False) or getattr(engine, "cobalt_config", None) is None:
        raise ValueError("migrate needs the engine ds_cobalt.initialize returns (a CobaltEngine with its \"cobalt\" "
                         "config; the HF CobaltCallback makes one too): after a migration a plain DeepSpeed engine's "
                         "save_checkpoint and save_16bit_model would write the moved experts under other experts' "
                         "names. Convert it first: ds_cobalt.CobaltEngine.adopt(engine, "
                         "ds_cobalt.parse_cobalt_config({...}))")
    if getattr(engine, "cobalt_accumulating", False):  # a backward since the last optimizer step (`CobaltEngine`)
        gas = engine.gradient_accumulation_steps() if hasattr(engine, "gradient_accumulation_steps") else 1
        raise ValueError(f"migrate runs between optimizer steps; this engine is inside a gradient-accumulation "
                         f"window (gradient_accumulation_steps={gas}: a backward ran since the last optimizer "
                         "step): the gradients accumulated so far would stay with the old owners")
    flush_pending(engine)
    fault_hook = fault_hook or _FAULT_HOOK
    step = int(getattr(engine, "global_steps", 0))
    start = time.perf_counter()
    plans = _plan_layers(engine, new_slots)
    moving = [p for p in plans if not p[3].empty]
    io = ExpertStateIO(engine, moving[0][1].expert_state_pieces(0)[0][0]) if moving else None
    if asynchronous:
        return PendingMigration(engine, plans, io, reason, predicted_saving_s, fault_hook, step, start)
    staged: list[torch.Tensor] = []
    error: str | None = None
    bytes_sent = bytes_moved = 0
    with torch.no_grad():
        for index, layer, _, moves in moving:
            rows = None
            if error is None:
                try:
                    rows = _read_rows(io, layer, moves)
                    if fault_hook is not None:
                        fault_hook("pack", index)
                        fault_hook("transfer", index)
                except Exception as err:  # noqa: BLE001 - any failure aborts the whole migration
                    error = f"layer {index}: {type(err).__name__}: {err}"
            first = layer.expert_state_pieces(0)
            F = io.row_size(first)
            if rows is None:
                device = first[0][0].device
                rows = torch.zeros((len(moves.send_slot), F), dtype=torch.float32, device=device)
            recv = rows.new_zeros((sum(moves.recv_splits), F))
            try:
                recv = all_to_all_rows(rows, moves.send_splits, moves.recv_splits, layer.groups.ep_group)
                if error is None and fault_hook is not None:
                    fault_hook("stage", index)
                if recv.shape != (sum(moves.recv_splits), F):
                    raise RuntimeError(f"received {list(recv.shape)} rows, expected {[sum(moves.recv_splits), F]}")
            except Exception as err:  # noqa: BLE001
                error = error or f"layer {index}: {type(err).__name__}: {err}"
            staged.append(recv.clone() if recv.data_ptr() == rows.data_ptr() else recv)
            sent, moved = _traffic(io, layer, moves)
            bytes_sent, bytes_moved = bytes_sent + sent, bytes_moved + moved

        # Phase 2: agree, then swap. Only local writes from here on.
        ok = _all_ranks_ok(error is None, job_group([p[1] for p in plans]))
        if ok:
            for (_, layer, _, moves), recv in zip(moving, staged):
                _write_rows(io, layer, moves, recv)
            for _, layer, slots, _ in plans:
                layer.install_layout(slots)
    report = MigrationReport(
        ok=ok, step=step, reason=reason,
        moved=tuple((index, e, a, b) for index, _, _, moves in moving for e, a, b in moves.moved),
        bytes_moved=bytes_moved, bytes_sent=bytes_sent, seconds=time.perf_counter() - start,
        predicted_saving_s=predicted_saving_s, error=error)
    _record(engine, report)
    return report


class PendingMigration:
    """A migration whose transfers run behind the next forward.

    Right after the step: every rank reads its moving experts' rows, one all-reduce confirms the reads
    succeeded everywhere, and each layer's all-to-all starts asynchronously. Then each layer commits in a
    forward pre-hook (or in `flush`, before the next optimizer step or checkpoint): wait for its own
    transfer, one all-reduce to agree, write the staged rows, install the layout. A layer whose transfer
    failed anywhere keeps its old layout and state; each layer is all-or-nothing on its own.
    """

    def __init__(self, engine: Any, plans: list, io: "ExpertStateIO | None", reason: str,
                 predicted_saving_s: float | None, fault_hook: FaultHook | None, step: int, start: float) -> None:
        self.engine, self.io, self.reason, self.fault_hook = engine, io, reason, fault_hook
        self.predicted_saving_s, self.step, self.start = predicted_saving_s, step, start
        self.errors: list[str] = []
        self.moved: list[tuple[int, int, int, int]] = []
        self.bytes_sent = self.bytes_moved = 0
        self.report: MigrationReport | None = None
        self._pending: dict[int, tuple] = {}
        self._group = job_group([p[1] for p in plans])
        moving = [p for p in plans if not p[3].empty]
        read: list[tuple[int, torch.Tensor]] = []
        error = None
        with torch.no_grad():
            for index, layer, _, moves in moving:
                try:
                    read.append((index, _read_rows(io, layer, moves)))
                    if fault_hook is not None:
                        fault_hook("pack", index)
                except Exception as err:  # noqa: BLE001
                    error = error or f"layer {index}: {type(err).__name__}: {err}"
        if not _all_ranks_ok(error is None, self._group):
            self.errors.append(error or "a read failed on another rank")
            self._finish()
            return
        rows_of = dict(read)
        for index, layer, slots, moves in plans:
            if moves.empty:
                layer.install_layout(slots)  # replica-only change: nothing to move
                continue
            rows = rows_of[index]
            recv, work, failure = rows, None, None
            group = layer.groups.ep_group
            try:
                if fault_hook is not None:
                    fault_hook("transfer", index)
            except Exception as err:  # noqa: BLE001 - reported at the commit; the transfer still runs
                failure = f"layer {index}: {type(err).__name__}: {err}"
            try:  # posted on every rank, failed or not, so that every rank's collectives still pair up
                if group is not None:
                    recv = rows.new_empty((sum(moves.recv_splits), rows.shape[1]))
                    work = dist.all_to_all_single(recv, rows, list(moves.recv_splits), list(moves.send_splits),
                                                  group=group, async_op=True)
            except Exception as err:  # noqa: BLE001
                work = _Failed(f"layer {index}: {type(err).__name__}: {err}")
            layer.call_before_next_forward(lambda index=index: self._commit_if_pending(index))
            self._pending[index] = (layer, slots, moves, rows, recv, work, failure)
        engine.cobalt_pending_migration = self
        if not self._pending:
            self._finish()

    @property
    def done(self) -> bool:
        return not self._pending

    def _commit_if_pending(self, index: int) -> None:
        if index in self._pending:  # not flushed already
            self.commit(index)

    def commit(self, index: int) -> None:
        """Wait for layer `index`'s transfer, agree on every rank, then swap its state and layout."""
        layer, slots, moves, rows, recv, work, failure = self._pending.pop(index)
        error = None
        try:
            if isinstance(work, _Failed):
                raise RuntimeError(work.message)
            if work is not None:
                work.wait()
            if failure is not None:
                raise RuntimeError(failure)
            if self.fault_hook is not None:
                self.fault_hook("stage", index)
        except Exception as err:  # noqa: BLE001
            error = f"layer {index}: {type(err).__name__}: {err}"
        if _all_ranks_ok(error is None, self._group):
            with torch.no_grad():
                _write_rows(self.io, layer, moves, recv)
            layer.install_layout(slots)
            self.moved += [(index, e, a, b) for e, a, b in moves.moved]
            sent, moved = _traffic(self.io, layer, moves)
            self.bytes_sent, self.bytes_moved = self.bytes_sent + sent, self.bytes_moved + moved
        else:
            self.errors.append(error or f"layer {index}: transfer failed on another rank")
        if not self._pending:
            self._finish()

    def flush(self) -> None:
        for index in sorted(self._pending):
            self.commit(index)

    def _finish(self) -> None:
        if getattr(self.engine, "cobalt_pending_migration", None) is self:
            self.engine.cobalt_pending_migration = None
        self.report = MigrationReport(
            ok=not self.errors, step=self.step, reason=self.reason, moved=tuple(self.moved),
            bytes_moved=self.bytes_moved, bytes_sent=self.bytes_sent, seconds=time.perf_counter() - self.start,
            predicted_saving_s=self.predicted_saving_s, error="; ".join(self.errors) or None)
        _record(self.engine, self.report)


@dataclass(frozen=True)
class _Failed:
    message: str


def flush_pending(engine: Any) -> None:
    """Commit what an asynchronous migration still has in flight (collective)."""
    pending = getattr(engine, "cobalt_pending_migration", None)
    if pending is not None:
        pending.flush()


def _all_ranks_ok(local_ok: bool, group: dist.ProcessGroup | None) -> bool:
    flag = torch.tensor([1 if local_ok else 0], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        flag = all_reduce_host(flag, dist.ReduceOp.MIN, group)
    return bool(flag.item())  # NOTE: host sync


def _record(engine: Any, report: MigrationReport) -> None:
    history = getattr(engine, "cobalt_migrations", None)
    if history is None:
        history = []
        engine.cobalt_migrations = history
    history.append(report)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if report.error is not None:
        logger.error(f"ds_cobalt migration ({report.reason}) at step {report.step} failed on rank {rank}: "
                     f"{report.error}; old layout and state kept")
    if rank == 0:
        experts = ", ".join(f"L{l}:e{e} r{a}->r{b}" for l, e, a, b in report.moved) or "none"
        saving = "n/a" if report.predicted_saving_s is None else f"{report.predicted_saving_s:.4g} s"
        if report.ok:
            logger.info(f"ds_cobalt migration ({report.reason}) at step {report.step}: moved {len(report.moved)} "
                        f"experts [{experts}], {report.bytes_moved} B across ranks in {report.seconds:.3f} s, "
                        f"predicted saving {saving}")
        else:
            logger.warning(f"ds_cobalt migration ({report.reason}) at step {report.step} aborted on at least one "
                           f"rank; kept the old layout ({len(report.moved)} experts would have moved)")
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and getattr(monitor, "enabled", False):
        s = report.step
        events = [("ds_cobalt/migration/ok", float(report.ok), s),
                  ("ds_cobalt/migration/experts_moved", float(len(report.moved)), s),
                  ("ds_cobalt/migration/bytes_moved", float(report.bytes_moved), s),
                  ("ds_cobalt/migration/seconds", float(report.seconds), s)]
        if report.predicted_saving_s is not None:
            events.append(("ds_cobalt/migration/predicted_saving_s", float(report.predicted_saving_s), s))
        monitor.write_events(events)
