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
as logged. A checkpoint without these files (a run without re-planning) also starts fresh. A truncated or foreign
file raises ValueError naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from deepspeed.utils import logger
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["FORMAT", "replan_state_path", "save_replan_state", "load_replan_state", "tag_directory",
           "latest_tag_directory"]

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
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_replan_state(engine: Any, directory: str | os.PathLike) -> bool:
    """Restore this rank's replanner state from `directory`; False (logged) when it does not apply."""
    hook = _stateful_hook(engine)
    if hook is None:
        return False
    rank, _ = _rank_world()
    path = replan_state_path(directory, rank)
    if not path.exists():
        logger.info(f"ds_cobalt: no replanner state in {directory}; routing statistics start fresh")
        return False
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
        logger.info(f"ds_cobalt: replanner state in {directory} is for {saved}, this run is {_shape(hook)}; "
                    "routing statistics start fresh")
        return False
    try:
        hook.restore(tensors, meta)
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: inconsistent replanner state ({type(e).__name__}: {e})") from e
    return True


def tag_directory(directory: str | os.PathLike, tag: Any, global_steps: int) -> Path:
    """The tag directory DeepSpeed writes: `tag`, or its default `global_step<N>`."""
    return Path(directory) / (str(tag) if tag is not None else f"global_step{global_steps}")


def latest_tag_directory(directory: str | os.PathLike, tag: Any) -> Path | None:
    """The tag directory a load reads: `tag`, or the one named in DeepSpeed's `latest` file."""
    if tag is not None:
        return Path(directory) / str(tag)
    latest = Path(directory) / "latest"
    return Path(directory) / latest.read_text().strip() if latest.exists() else None
