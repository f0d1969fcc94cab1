"""World-size-independent training state beside a DeepSpeed checkpoint (`cobalt_state_rank*.pt`).

DeepSpeed 0.19.8's optimizer files cannot be loaded at another world size (ZeRO-1/2 refuse to repartition;
without ZeRO each expert-parallel rank's file holds its own experts). Beside every checkpoint, each rank
writes the full fp32 training state of the parameters it is responsible for, keyed by name with logical
expert ids: weight, fp32 master copy, optimizer moments (and `step` where the optimizer keeps one per
parameter), read through DeepSpeed's tensor-fragment API (`ExpertStateIO`). Dense parameters are written by
rank 0, experts by their owners. `load_portable_state` writes it back into an engine of any world size,
ranks per node and layout (after `load_checkpoint(..., load_module_only=True)`), including the optimizer's
per-group step counts.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param

from .deepspeed_moe import MoE
from .expert_state import ExpertStateIO, Piece, relink_optimizer_state

FORMAT = "ds-cobalt/portable-state-v1"
_EXPERT = re.compile(r"^(?P<layer>.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<slot>\d+)\.(?P<rest>.+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _keyed_parameters(engine: Any) -> list[tuple[str, Piece, bool]]:
    """(key, piece, is_expert) in module order; expert keys carry the logical expert id. A fused expert tensor
    (AutoEP's `experts.w1/w2/w3`) gives one piece per row: `<layer>.experts.<expert>.w1`."""
    layers = {name: m for name, m in engine.module.named_modules() if isinstance(m, MoE)}
    fused = {f"{name}.experts.{w}": (name, m) for name, m in engine.module.named_modules()
             if hasattr(m, "expert_state_pieces") and not isinstance(m, MoE) for w in ("w1", "w2", "w3")}
    out = []
    for name, p in engine.module.named_parameters():
        match = _EXPERT.match(name)
        if match and match["layer"] in layers:
            layer = layers[match["layer"]]
            expert = int(layer.layout_slots[layer.topology.rank, int(match["slot"])])
            out.append((f"{match['layer']}.experts.{expert}.{match['rest']}", (p, None), True))
        elif name in fused:
            layer_name, layer = fused[name]
            owners = layer.layout_slots[layer.topology.rank, : layer.num_local_experts]
            out += [(f"{layer_name}.experts.{int(e)}.{name.rsplit('.', 1)[1]}", (p, slot), True)
                    for slot, e in enumerate(owners)]
        else:
            if is_moe_param(p):
                raise ValueError(f"portable state: expert parameter {name} is not in a ds_cobalt layer")
            out.append((name, (p, None), False))
    return out


def _group_steps(engine: Any) -> list[float]:
    """The inner optimizer's step count of each flat ZeRO partition (empty without ZeRO)."""
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None)
    if flats is None:
        return []
    state = opt.optimizer.state
    return [float(state[f]["step"]) if f in state and "step" in state[f] else 0.0 for f in flats]


def save_portable_state(engine: Any, checkpoint_dir: str) -> str:
    """Collective: every rank writes `checkpoint_dir/cobalt_state_rank{r}.pt`; returns this rank's path."""
    rank = _rank()
    rows: dict[str, torch.Tensor] = {}
    fields: dict[str, list[str]] = {}
    with torch.no_grad():
        for key, piece, expert in _keyed_parameters(engine):
            io = ExpertStateIO(engine, piece[0])
            row = io.read([piece])  # collective for ZeRO fragments: every rank reads every parameter it holds
            if expert or rank == 0:
                rows[key], fields[key] = row.cpu(), io.fields_of(piece)
    payload = {"format": FORMAT, "rank": rank, "rows": rows, "fields": fields,
               "group_steps": _group_steps(engine), "global_steps": int(getattr(engine, "global_steps", 0))}
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, f"cobalt_state_rank{rank}.pt")
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write never leaves a truncated file under the real name
    return path


def has_portable_state(checkpoint_dir: str) -> bool:
    return bool(glob.glob(os.path.join(checkpoint_dir, "cobalt_state_rank*.pt")))


def load_portable_state(engine: Any, checkpoint_dir: str) -> None:
    """Write the saved state into `engine` (any world size and layout). ValueError names what is missing."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, "cobalt_state_rank*.pt")))
    if not files:
        raise ValueError(f"portable state: no cobalt_state_rank*.pt in {checkpoint_dir}")
    rows: dict[str, torch.Tensor] = {}
    fields: dict[str, list[str]] = {}
    saved = None
    for path in files:
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if payload.get("format") != FORMAT:
            raise ValueError(f"portable state: {path} has format {payload.get('format')!r}, expected {FORMAT!r}")
        rows.update(payload["rows"])
        fields.update(payload["fields"])
        if payload["rank"] == 0:
            saved = payload
    if saved is None:
        raise ValueError(f"portable state: rank 0's file is missing in {checkpoint_dir}")
    _ensure_zero_state(engine, {f for names in fields.values() for f in names})
    relink_optimizer_state(engine.optimizer)
    with torch.no_grad():
        for key, piece, _ in _keyed_parameters(engine):
            p = piece[0]
            if key not in rows:
                raise ValueError(f"portable state: no saved state for parameter {key}")
            io = ExpertStateIO(engine, p)
            _ensure_torch_state(io, p, fields[key])
            io = ExpertStateIO(engine, p)
            if io.fields_of(piece) != fields[key]:
                raise ValueError(f"portable state: {key} was saved with {fields[key]}, "
                                 f"this optimizer has {io.fields_of(piece)}")
            io.write([piece], rows[key].to(p.device))
    _restore_group_steps(engine, saved["group_steps"])
    engine.global_steps = saved["global_steps"]


def _ensure_zero_state(engine: Any, saved_fields: set[str]) -> None:
    """ZeRO-1/2 create the inner optimizer's state of each flat partition at the first step: create the
    moments the saved state has (zeros, with step 0) so there is something to write into and link."""
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None)
    if not flats:
        return
    moments = sorted(saved_fields - {"weight", "fp32", "step"})
    state = opt.optimizer.state
    for flat in flats:
        entry = state[flat]  # a defaultdict in torch optimizers
        for key in moments:
            if key not in entry:
                entry[key] = torch.zeros_like(flat)
        if moments and "step" not in entry:
            entry["step"] = torch.zeros((), dtype=torch.float32)


def _ensure_torch_state(io: ExpertStateIO, p: torch.nn.Parameter, saved_fields: list[str]) -> None:
    """A torch optimizer creates its state at the first step: create what the saved fields need."""
    if io.mode == "fragment":
        return
    master = io._master_of(p)
    state = io._state.setdefault(master, {})
    for field in saved_fields:
        if field in ("weight", "fp32") or field in state:
            continue
        state[field] = torch.zeros((), dtype=torch.float32) if field == "step" else torch.zeros_like(master)


def _restore_group_steps(engine: Any, steps: list[float]) -> None:
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None)
    if not flats or not steps:
        return
    state = opt.optimizer.state
    for flat, step in zip(flats, steps):
        if flat in state and "step" in state[flat]:
            current = state[flat]["step"]
            state[flat]["step"] = torch.tensor(step, dtype=current.dtype) if torch.is_tensor(current) else step

