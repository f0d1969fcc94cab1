"""The replanner's state beside a checkpoint, for an exact resume (`cobalt_replan_rank{r}.safetensors`).

A resumed run plans the same layouts at the same steps as an uninterrupted one only if it has the same routing
statistics: each rank's counts since the last re-plan (`stats.<layer>.*`: load, co-activation, the sample ring
buffer and its token count) and, when a plan was in flight at the save, this rank's request (`pending.*`: the
gathered statistics and layouts of its share of the layers), which the loading rank submits again; planning is
deterministic, so its decisions are the same. Each global rank writes one file into the checkpoint's tag
directory, tensors only, read without unpickling anything. Header metadata (strings): `format`
(`ds-cobalt/replan-state-v1`), `rank`, `world_size`, `layers`, `num_experts`, `global_steps`, `apply_at` (the
step whose hook applies the plan in flight, "" = none), `pending` (the request's tag, "" = none), and with one
`pending_layers` and `params` (JSON).

Loading needs the same world size, layers and experts; otherwise (a resharded resume) the statistics start fresh,
as logged. A checkpoint without these files (a run without re-planning) also starts fresh, and so does every rank
where some ranks' files are missing (all ranks agree, so none resubmits a plan alone). `CobaltEngine` writes
DeepSpeed's `latest` only after every rank wrote these files (`write_latest`). A truncated or foreign file raises
ValueError naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import logger
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..planner.files import write_atomically, write_text_atomically
from ..runtime.comm import all_reduce_host
from .layers import job_group, layer_cores

__all__ = ["FORMAT", "replan_state_path", "save_replan_state", "load_replan_state", "tag_directory",
           "latest_tag_directory", "write_latest", "checkpoint_tag"]

FORMAT = "ds-cobalt/replan-state-v1"


def replan_state_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"cobalt_replan_rank{rank}.safetensors"


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _stateful_hook(engine: Any) -> Any | None:
    for hook in getattr(engine, "cobalt_step_hooks", []):
        if hasattr(hook, "state") and hasattr(hook, "restore") and getattr(hook, "layers", None):
            return hook
    return None


def _shape(hook: Any) -> dict[str, str]:
    _, world = _rank_world()
    return {"world_size": str(world), "layers": str(len(hook.layers)), "num_experts": str(hook.layers[0].num_experts)}


def save_replan_state(engine: Any, directory: str | os.PathLike) -> None:
    """Every rank writes its file (nothing when the engine does not re-plan)."""
    hook = _stateful_hook(engine)
    if hook is None:
        return
    rank, _ = _rank_world()
    tensors, meta = hook.state()
    meta = {"format": FORMAT, "rank": str(rank), "global_steps": str(int(engine.global_steps)), **_shape(hook),
            **meta}
    path = replan_state_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    host = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    try:
        write_atomically(path, lambda tmp: save_file(host, tmp, metadata=meta))
    except SafetensorError as e:  # (a full disk reads as this)
        raise OSError(f"could not write {path}: {e}") from e


MISSING, UNREADABLE = -1, -2  # a rank's status in `load_replan_state`'s agreement (else its file's step count)


def load_replan_state(engine: Any, directory: str | os.PathLike) -> bool:
    """Restore the replanner state from `directory`, on every rank or on none: where some ranks' files are missing,
    do not apply (an interrupted save, a resharded resume) or come from different saves, every rank starts its
    statistics fresh, as logged, so that no rank resubmits a plan the others do not. A truncated or foreign file
    raises ValueError naming it, on every rank (the others name the rank). Collective: one all-reduce of every rank's
    status, one of the restores' outcome."""
    hook = _stateful_hook(engine)
    if hook is None:
        return False
    rank, world = _rank_world()
    group = job_group(hook.layers) if world > 1 else None
    path = replan_state_path(directory, rank)
    loaded, error = None, None
    try:
        loaded = _read(path, hook, rank) if path.exists() else None
    except ValueError as e:
        error = e
    status = torch.zeros(world, dtype=torch.int64)
    status[rank] = UNREADABLE if error is not None else MISSING if loaded is None else _saved_steps(loaded[1])
    if world > 1:
        status = all_reduce_host(status, group=group)
    unreadable = [r for r in range(world) if status[r] == UNREADABLE]
    if unreadable:
        raise error or ValueError(f"ds_cobalt: the replanner state of rank(s) {unreadable} in {directory} is "
                                  "unreadable (their error names the file)")
    missing = [r for r in range(world) if status[r] == MISSING]
    if missing or len(set(status.tolist())) > 1:
        if rank == 0:
            why = (f"missing or for another run shape on rank(s) {missing}" if missing else
                   f"written at different steps {sorted(set(status.tolist()))} (files of different saves)")
            (logger.warning if len(missing) < world else logger.info)(
                f"ds_cobalt: replanner state in {directory}: {why}; routing statistics start fresh on every rank")
        return False
    tensors, meta = loaded
    restored = torch.ones(1, dtype=torch.int64)
    try:
        hook.restore(tensors, meta)
    except (KeyError, RuntimeError, ValueError) as e:
        error, restored[0] = ValueError(f"{path}: inconsistent replanner state ({type(e).__name__}: {e})"), 0
    if world > 1:
        restored = all_reduce_host(restored, dist.ReduceOp.MIN, group)
    if not int(restored[0]):
        raise error or ValueError(f"ds_cobalt: the replanner state in {directory} is inconsistent on another rank "
                                  "(its error names the file)")
    return True


def _saved_steps(meta: dict) -> int:
    steps = str(meta.get("global_steps", ""))
    return int(steps) if steps.isdigit() else 0


def _read(path: Path, hook: Any, rank: int) -> tuple[dict, dict] | None:
    """`(tensors, metadata)` of this rank's file; None (logged) where it is for another world size or model."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a ds_cobalt replanner state (format {meta.get('format')!r}, "
                                 f"expected {FORMAT!r})")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: unreadable replanner state (truncated or not a safetensors file): {e}") from e
    saved = {k: meta.get(k) for k in ("world_size", "layers", "num_experts")}
    if saved != _shape(hook) or meta.get("rank") != str(rank):
        logger.info(f"ds_cobalt: replanner state {path} is for {saved}, this run is {_shape(hook)}")
        return None
    return tensors, meta


def checkpoint_tag(tag: Any, global_steps: int) -> str:
    """The tag DeepSpeed saves under: `tag` as a string, or its default `global_step<N>`."""
    return str(tag) if tag is not None else f"global_step{global_steps}"


def tag_directory(directory: str | os.PathLike, tag: Any, global_steps: int) -> Path:
    """The tag directory DeepSpeed writes (`checkpoint_tag`)."""
    return Path(directory) / checkpoint_tag(tag, global_steps)


def write_latest(engine: Any, directory: str | os.PathLike, tag: Any) -> None:
    """Collective: once every rank is here (all its checkpoint files written), rank 0 points DeepSpeed's `latest`
    file at `tag` (atomically), as DeepSpeed's own save would."""
    group = job_group(layer_cores(engine)) if dist.is_initialized() else None
    if dist.is_initialized():
        dist.barrier(group=group)
    if _rank_world()[0] == 0:
        write_text_atomically(Path(directory) / "latest", checkpoint_tag(tag, engine.global_steps))
    if dist.is_initialized():
        dist.barrier(group=group)


def latest_tag_directory(directory: str | os.PathLike, tag: Any) -> Path | None:
    """The tag directory a load reads: `tag`, or the one named in DeepSpeed's `latest` file."""
    if tag is not None:
        return Path(directory) / str(tag)
    latest = Path(directory) / "latest"
    return Path(directory) / latest.read_text().strip() if latest.exists() else None
