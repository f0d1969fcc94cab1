"""Record routing traces (DESIGN.md `.npz` format) from a training run.

Each ds_cobalt layer keeps the top-k ids of its forwards while recording; `save_trace` gathers every
rank's rows to rank 0 and writes `experts [L, T, K]`, `num_experts` and `source_rank [T]` (global ranks),
tokens ordered by forward, then rank. `TraceRecorder` is the step hook of `cobalt.trace`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import logger

from ..planner.trace import Trace
from ..planner.trace import save_trace as write_trace
from ..runtime.comm import all_reduce_host
from .layers import job_group, layer_cores


def start_trace(model: torch.nn.Module, training_only: bool = False) -> None:
    """Start (or restart) recording the routing of every ds_cobalt layer of `model`: of every forward, or of the
    training-mode ones only (`cobalt.trace`, which records optimizer steps)."""
    for layer in layer_cores(model):
        layer.trace_rows = []
        layer.trace_training_only = training_only


def stop_trace(model: torch.nn.Module) -> None:
    for layer in layer_cores(model):
        layer.trace_rows = None


def save_trace(model: torch.nn.Module, path: str | Path) -> Path | None:
    """Collective: gather the recorded routing to rank 0 and write it; returns the path on rank 0."""
    layers = layer_cores(model)
    if not layers or any(layer.trace_rows is None for layer in layers):
        raise RuntimeError("save_trace: no trace is recording; call start_trace (or set cobalt.trace) first")
    forwards = {len(layer.trace_rows) for layer in layers}
    if len(forwards) != 1:
        raise RuntimeError(f"save_trace: layers recorded different numbers of forwards {sorted(forwards)}")
    K = max(layer.top_k for layer in layers)
    per_forward = []  # [(L, T_f, K) ids] of this rank
    for step_rows in zip(*(layer.trace_rows for layer in layers)):
        T = step_rows[0].shape[0]
        block = np.full((len(layers), T, K), -1, dtype=np.int64)
        for l, rows in enumerate(step_rows):
            block[l, :, : rows.shape[1]] = rows.numpy()
        per_forward.append(block)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    gathered = [per_forward] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(gathered, per_forward, group=job_group(layers))
    if rank != 0:
        return None
    blocks = [gathered[r][f] for f in range(len(per_forward)) for r in range(world)]
    sources = [np.full(gathered[r][f].shape[1], r, dtype=np.int64)
               for f in range(len(per_forward)) for r in range(world)]
    experts = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(layers), 0, K), dtype=np.int64)
    source = np.concatenate(sources) if sources else np.zeros(0, dtype=np.int64)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(Trace(experts, layers[0].num_experts, source), path)
    return path


class TraceRecorder:
    """The step hook of `cobalt.trace`: records the routing of optimizer steps [`first`, `first + steps`) and
    writes it after the last of them. A run that ends inside that window loses nothing: `finish` (called by
    `CobaltEngine.destroy` and `save_cobalt_trace`, collective) writes the steps recorded so far and says so; one
    that recorded nothing (it ended before `first`, or resumed from a checkpoint past it) is told so."""

    def __init__(self, engine: torch.nn.Module, path: str | Path, first: int, steps: int) -> None:
        self.path, self.first, self.last = Path(path), first, first + steps
        _check_trace_path_on_rank0(engine, self.path)  # a bad path fails now, on every rank, not after the window
        self.done = False
        self.started_at: int | None = None  # the step recording started after (None: not recording)
        self._next = 0  # the step count the next hook call expects while recording
        if first == 0:
            self._start(engine, 0)

    def __call__(self, engine: torch.nn.Module) -> None:
        step = engine.global_steps
        if self.done:
            return
        if self.started_at is not None and step != self._next:  # the count jumped (a checkpoint load): what was
            stop_trace(engine)                                   # recorded does not lead up to this step
            self.started_at = None
        if self.started_at is None and self.first <= step < self.last:
            self._start(engine, step)  # at `first`, or inside the window after a resume: [step, last)
        elif self.started_at is not None and step >= self.last:
            self._write(engine, f"wrote the routing of steps [{self.started_at}, {step}) to {self.path}")
        self._next = step + 1

    def finish(self, engine: torch.nn.Module) -> None:
        """Collective: where the window is still open, write what it recorded (or say that it recorded nothing)."""
        if self.done:
            return
        self.done = True
        step = engine.global_steps
        if self.started_at is None or step <= self.started_at or step != self._next - 1:  # (a load since: a jump)
            stop_trace(engine)
            if engine.global_rank == 0:
                why = (f"before trace.start_step={self.first}" if step <= self.first else
                       f"and its window [{self.first}, {self.last}) was not reached in this process (a resume?)")
                logger.warning(f"ds_cobalt: cobalt.trace recorded nothing: the run ended after step {step}, {why}; "
                               f"{self.path} is not written")
            return
        self._write(engine, f"the run ended inside cobalt.trace's window: wrote the routing of steps "
                            f"[{self.started_at}, {step}) of [{self.first}, {self.last}) to {self.path}", warn=True)

    def _start(self, engine: torch.nn.Module, step: int) -> None:
        start_trace(engine, training_only=True)
        self.started_at, self._next = step, step + 1
        if engine.global_rank == 0:
            logger.info(f"ds_cobalt: recording the routing of steps [{self.first}, {self.last}) for {self.path}")

    def _write(self, engine: torch.nn.Module, message: str, warn: bool = False) -> None:
        self.done = True
        try:
            save_trace(engine, self.path)
        except OSError as e:  # rank 0's write (after the gather, so every rank is past the collective): a trace is
            # a diagnostic, the training goes on
            logger.error(f"ds_cobalt: cobalt.trace could not be written ({e}); training continues")
            stop_trace(engine)
            return
        stop_trace(engine)
        if engine.global_rank == 0:
            (logger.warning if warn else logger.info)(f"ds_cobalt: {message}")


def _check_trace_path_on_rank0(engine: torch.nn.Module, path: Path) -> None:
    """`_check_trace_path` on rank 0 (the rank that writes the trace); collective: every rank raises with it."""
    error = None
    if engine.global_rank == 0:
        try:
            _check_trace_path(path)
        except ValueError as e:
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = all_reduce_host(torch.tensor([int(error is not None)]), group=job_group(layer_cores(engine)))
        if error is None and int(flag[0]):
            error = ValueError(f"cobalt.trace.path {path} cannot be written by rank 0 (its error says why)")
    if error is not None:
        raise error


def _check_trace_path(path: Path) -> None:
    """ValueError naming `cobalt.trace.path` where rank 0 could not write it (its missing directories are made)."""
    if path.is_dir():
        raise ValueError(f"cobalt.trace.path {path} is a directory; give a file name (.npz)")
    existing = path.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"cobalt.trace.path {path} is not writable here ({existing}: read-only, no permission or "
                         "not a directory)")
