"""Checkpoints in logical expert order through DeepSpeed's own `engine.save_checkpoint` / `load_checkpoint`.

DeepSpeed names each saved expert file by `ep_rank * num_local_experts + local_id`, and stores the expert
optimizer state per EP rank (ZeRO: `zero_pp_rank_*` partitions of the expert param group; no ZeRO:
`expp_rank_*_optim_states.pt`), in module order. Both are logical expert order exactly when the owners sit
in DeepSpeed's contiguous layout. So `save_checkpoint` migrates to the contiguous layout (weights and
optimizer state, `migration.migrate`), lets DeepSpeed write, and migrates back; the ds_cobalt layout rides
along in the client state under `"ds_cobalt"`. `load_checkpoint` installs the contiguous tables, lets
DeepSpeed load, re-links ZeRO's optimizer-state fragments, and migrates to the saved layout when the
topology matches (else training continues from the contiguous layout, and the next replan moves it). With the
layout come `auto`'s decisions for it (`"decisions"`, one `LayerCore.decision_state()` per layer: the schedule in
use, the gate's verdicts, the histories): a resumed run keeps the schedules and owner-move verdicts of the run that
saved; the round trip to logical order keeps them too, so a save does not re-time the layers.

The files are therefore exactly DeepSpeed's: they load into vanilla `deepspeed.moe.layer.MoE` and back.
What DeepSpeed's format itself cannot do is optimizer state at a different data-parallel / expert-parallel
world size (ZeRO-1/2 raise "Automatic adjustment of ZeRO's optimizer state partitioning with a new world
size is not currently supported"; without ZeRO the per-EP-rank optimizer file holds a different number of
experts). For that every save also writes `portable.py`'s state beside DeepSpeed's files; at another world
size or expert-parallel size, `load_checkpoint(dir, load_module_only=True)` loads DeepSpeed's weights and then
restores every parameter's master copy and optimizer state from it (at the sizes that saved it, the module only,
as DeepSpeed does; `cobalt_portable_state=True` restores it there too).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np
import torch.distributed as dist
from deepspeed.utils import logger

from ..planner.layout import contiguous_layout
from .migration import flush_pending, migratable_layers, migrate, relink_optimizer_state
from .portable import has_portable_state, load_portable_state, save_portable_state, saved_world_size
from .replan_state import checkpoint_tag, latest_tag_directory

CLIENT_KEY = "ds_cobalt"
FORMAT = "ds-cobalt/checkpoint-v1"


def _contiguous(layer: Any) -> np.ndarray:
    topo = layer.topology
    return contiguous_layout(layer.num_experts, topo.nodes, topo.ranks_per_node).layer(0)


def _owners_contiguous(layer: Any) -> bool:
    P = layer.num_local_experts
    return np.array_equal(layer.layout_slots[:, :P], _contiguous(layer))


def save_checkpoint(engine: Any, save: Any, portable_state: bool, save_dir: str, tag: Any = None,
                    client_state: dict | None = None, *args: Any, **kwargs: Any) -> Any:
    """`save(save_dir, tag, client_state, ...)` (DeepSpeed's own save) in logical expert order; with
    `portable_state` also writes the world-size-independent state of `portable.py` beside it."""
    tag = checkpoint_tag(tag, engine.global_steps)
    result = save_logical(engine, save, save_dir, tag, client_state, *args, **kwargs)
    if portable_state:
        save_portable_state(engine, os.path.join(save_dir, str(tag)))
    return result


def load_checkpoint(engine: Any, load: Any, portable_state: bool, load_dir: str, tag: Any = None,
                    *args: Any, restore_portable: bool | None = None, **kwargs: Any) -> Any:
    """`load(load_dir, tag, ...)` (DeepSpeed's own load) of a logical-order checkpoint, then the saved layout.
    With `load_module_only=True` and portable state present, also the optimizer state from it where DeepSpeed's
    own full load cannot restore it (`restore_portable=None`: another world size or expert-parallel size), or as
    `restore_portable` says; elsewhere the module only, as DeepSpeed loads it."""
    result = load_logical(engine, load, load_dir, tag, *args, **kwargs)
    if portable_state and kwargs.get("load_module_only") and result[0] is not None:
        directory = latest_tag_directory(load_dir, tag)
        if directory is not None and has_portable_state(directory):
            why = _portable_restore_reason(engine, directory, result[1]) if restore_portable is None else \
                ("asked for" if restore_portable else None)
            if why is not None:
                load_portable_state(engine, directory)
                logger.info(f"ds_cobalt: restored weights and optimizer state from {directory} (portable state: "
                            f"{why})")
            elif _rank() == 0:
                logger.info(f"ds_cobalt: load_module_only at the world and expert-parallel sizes that saved "
                            f"{directory}: the module only, as DeepSpeed loads it (a load without load_module_only "
                            "restores the optimizer too)")
    return result


def _portable_restore_reason(engine: Any, directory: str, client_state: dict | None) -> str | None:
    """Why a `load_module_only` load restores the portable state: DeepSpeed's own full load could not (None where it
    could). Unreadable portable state counts as a reason, so `load_portable_state` reports what is wrong with it."""
    saved = saved_world_size(directory)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if saved is None:
        return "its manifest does not give the world size that saved it"
    if saved != world:
        return f"saved at world size {saved}, loaded at {world}"
    meta = (client_state or {}).get(CLIENT_KEY) or {}
    layers = migratable_layers(engine)
    if layers and meta.get("ep_size") not in (None, layers[0].topology.world_size):
        return f"saved at expert-parallel size {meta['ep_size']}, loaded at {layers[0].topology.world_size}"
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def layout_metadata(layers: list[Any]) -> dict:
    topo = layers[0].topology
    return {"format": FORMAT, "ep_size": topo.world_size, "ranks_per_node": topo.ranks_per_node,
            "num_experts": layers[0].num_experts, "layouts": [layer.layout_slots.tolist() for layer in layers],
            "decisions": [layer.decision_state() for layer in layers]}


class LogicalOrderError(RuntimeError):
    """The move to DeepSpeed's contiguous layout failed (the training layout is kept)."""


@contextlib.contextmanager
def logical_order(engine: Any, purpose: str = "logical order") -> Iterator[None]:
    """Inside the block every ds_cobalt layer's owners sit in DeepSpeed's contiguous layout (EP rank r holds experts
    r E/W to (r + 1) E/W - 1, spare slots empty), so `module.state_dict()` and the expert parameters mean what they
    mean in DeepSpeed's MoE; on exit the training layout (weights and optimizer state) comes back. Collective:
    every rank enters together, between optimizer steps. `LogicalOrderError`, before the block runs, where the
    move fails (the training layout is then kept)."""
    flush_pending(engine)
    layers = migratable_layers(engine)
    current = [layer.layout_slots.copy() for layer in layers]
    held = [layer.hold_decisions() for layer in layers]
    targets = [None if _owners_contiguous(layer) else _contiguous(layer) for layer in layers]
    moved = any(t is not None for t in targets)
    if moved:
        report = migrate(engine, targets, reason=f"{purpose}: to logical order")
        if not report.ok:
            raise LogicalOrderError(f"ds_cobalt: could not migrate to logical expert order for {purpose} "
                                    f"({report.error or 'failed on another rank'})")
    try:
        yield
    except BaseException:
        # the block failed on this rank, maybe on this rank only (a full or read-only disk): its peers may wait in
        # the block's own collectives (DeepSpeed's barriers), so the way back, a collective, would hang; the error
        # goes up instead, as DeepSpeed's own would. The layout stays the contiguous one (training stays exact)
        if moved:
            logger.error(f"ds_cobalt: {purpose} failed on rank {_rank()}; the layers stay in logical (contiguous) "
                         "order, not migrated back to the training layout")
        raise
    else:
        if moved:
            back = migrate(engine, current, reason=f"{purpose}: back to the training layout")
            if back.ok:  # the same layouts again: the schedule choices stand (no re-timing after a save)
                for layer, decisions in zip(layers, held):
                    layer.reinstate_decisions(decisions)
            else:
                logger.error("ds_cobalt: could not migrate back to the training layout; training continues in the "
                             "contiguous one (correct, but without the planned placement)")


def save_logical(engine: Any, save: Any, save_dir: str, tag: Any, client_state: dict | None,
                 *args: Any, **kwargs: Any) -> Any:
    layers = migratable_layers(engine)
    state = dict(client_state or {})
    if not layers:
        return save(save_dir, tag, state, *args, **kwargs)
    state[CLIENT_KEY] = layout_metadata(layers)
    try:
        with logical_order(engine, "checkpoint"):
            return save(save_dir, tag, state, *args, **kwargs)
    except LogicalOrderError as err:
        raise LogicalOrderError(f"{err}; nothing was saved") from None


def load_logical(engine: Any, load: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
    layers = migratable_layers(engine)
    before = [layer.layout_slots.copy() for layer in layers]
    for layer in layers:  # DeepSpeed loads expert files into owner modules in contiguous order
        layer.install_layout(_contiguous(layer))
    try:
        result = load(load_dir, tag, *args, **kwargs)
    except BaseException:
        for layer, slots in zip(layers, before):
            layer.install_layout(slots)
        raise
    path, client_state = result
    if path is None:  # nothing loaded: the parameters still match the old tables
        for layer, slots in zip(layers, before):
            layer.install_layout(slots)
        return result
    relink_optimizer_state(engine.optimizer)
    meta = (client_state or {}).get(CLIENT_KEY)
    if layers and meta is not None:
        topo = layers[0].topology
        expected = (FORMAT, topo.world_size, topo.ranks_per_node, layers[0].num_experts, len(layers))
        found = (meta.get("format"), meta.get("ep_size"), meta.get("ranks_per_node"), meta.get("num_experts"),
                 len(meta.get("layouts", [])))
        if found == expected:
            report = migrate(engine, [np.asarray(s, dtype=np.int64) for s in meta["layouts"]],
                             reason="checkpoint: restore saved layout")
            if not report.ok:
                logger.error("ds_cobalt: could not restore the saved layout; continuing in the contiguous one")
            else:  # `auto`'s choices for that layout go on as in the run that saved it
                for layer, decisions in zip(layers, meta.get("decisions") or []):
                    layer.restore_decisions(decisions)
        else:
            logger.info(f"ds_cobalt: checkpoint layout is for (ep_size, ranks_per_node, experts, layers) = "
                        f"{found[1:]}, this run is {expected[1:]}; continuing from the contiguous layout")
    return result
