"""World-size-independent training state beside a DeepSpeed checkpoint (`cobalt_state_rank*.{safetensors,json}`).

DeepSpeed 0.19.8's optimizer files cannot be loaded at another world size (ZeRO-1/2 refuse to repartition;
without ZeRO each expert-parallel rank's file holds its own experts). Beside every checkpoint, each rank
writes the full fp32 training state of the parameters it is responsible for, keyed by name with logical
expert ids: weight, fp32 master copy, optimizer moments (and `step` where the optimizer keeps one per
parameter), read through DeepSpeed's tensor-fragment API (`ExpertStateIO`). Dense parameters are written by
rank 0, experts by their owners. `load_portable_state` writes it back into an engine of any world size,
ranks per node and layout (after `load_checkpoint(..., load_module_only=True)`), including the optimizer's
per-group step counts.

File format `ds-cobalt/portable-state-v2`: tensors and plain metadata only, read without unpickling anything
(a checkpoint directory from elsewhere cannot run code when loaded). Each global rank r of the saving run writes
two files into the checkpoint's tag directory:

- `cobalt_state_rank{r}.safetensors`: one 1-D float32 tensor per key, the key's fields concatenated in the order
  of `fields[key]` (what `ExpertStateIO.read` returns; `step` is one value). Header metadata (strings):
  `format` (as below) and `save_id`.
- `cobalt_state_rank{r}.json`, the manifest::

    {"format": "ds-cobalt/portable-state-v2",
     "rank": r, "world_size": W,             # global rank and world size of the saving run
     "save_id": "<32 hex>",                  # shared by all W ranks of one save, also in the tensors file
     "tensors": "cobalt_state_rank{r}.safetensors", "tensors_bytes": n,   # its name and size in bytes
     "keys": [key, ...],                     # the tensors in the file: parameter names, experts as
                                             # "<layer>.experts.<logical id>.<rest>"
     "fields": {key: ["weight", "fp32", "exp_avg", "exp_avg_sq", ...]},
     "group_steps": [float, ...],            # the optimizer's step count per flat ZeRO partition ([] without ZeRO)
     "global_steps": int}                    # engine.global_steps

  Readers ignore keys they do not know; `group_steps` and `global_steps` are taken from rank 0.

Writing: the tensors file, then the manifest, each to `<name>.tmp` (flushed to disk) and renamed, so a crash never
leaves a truncated file under a real name, and a tensors file without its own manifest is rejected by `save_id`
and size. Reading: rank 0's manifest gives W and the save id; the files of ranks 0..W-1 must all be there and of
that save (files of ranks >= W are leftovers of an older, larger save and are ignored). A missing file raises
FileNotFoundError, a truncated, foreign or inconsistent one ValueError; both name the file.

The old format (`ds-cobalt/portable-state-v1`, `cobalt_state_rank{r}.pt`, a `torch.save` pickle) is read, when no
v2 file is present, only through `torch.load(weights_only=True)` (tensors and plain containers; torch >= 2.6,
whose restricted unpickler fixed CVE-2025-32434): a file that holds anything else is refused, not executed.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.utils import logger
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..planner.files import write_atomically, write_text_atomically
from ..planner.layout import is_json_int
from .deepspeed_moe import MoE
from .expert_state import ExpertStateIO, Piece, relink_optimizer_state

FORMAT = "ds-cobalt/portable-state-v2"
LEGACY_FORMAT = "ds-cobalt/portable-state-v1"
_EXPERT = re.compile(r"^(?P<layer>.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<slot>\d+)\.(?P<rest>.+)$")
_FILE = re.compile(r"^cobalt_state_rank(?P<rank>\d+)\.(?P<kind>json|safetensors|pt)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
    """Collective: every rank writes `checkpoint_dir/cobalt_state_rank{r}.safetensors` and its manifest
    `cobalt_state_rank{r}.json`; returns this rank's manifest path."""
    rank = _rank()
    rows: dict[str, torch.Tensor] = {}
    fields: dict[str, list[str]] = {}
    with torch.no_grad():
        for key, piece, expert in _keyed_parameters(engine):
            io = ExpertStateIO(engine, piece[0])
            row = io.read([piece])  # collective for ZeRO fragments: every rank reads every parameter it holds
            if expert or rank == 0:
                rows[key], fields[key] = row.cpu(), io.fields_of(piece)
    return write_state_files(checkpoint_dir, rank=rank, world_size=_world_size(), save_id=_shared_save_id(),
                             rows=rows, fields=fields, group_steps=_group_steps(engine),
                             global_steps=int(getattr(engine, "global_steps", 0)))


def has_portable_state(checkpoint_dir: str) -> bool:
    """Any portable-state file (v2 manifest or tensors, or an old `.pt`): `load_portable_state` then either
    restores it or says what is wrong with it, never silently skips a broken one."""
    return any(_state_files(checkpoint_dir).values())


def saved_world_size(checkpoint_dir: str) -> int | None:
    """The world size of the save that wrote `checkpoint_dir`'s portable state, from rank 0's manifest; None where
    there is none to read (old `.pt` files, or a missing or broken manifest: `load_portable_state` says which)."""
    try:
        return int(_read_manifest(checkpoint_dir, 0, "rank 0's manifest gives the world size")["world_size"])
    except (FileNotFoundError, ValueError):
        return None


def load_portable_state(engine: Any, checkpoint_dir: str) -> None:
    """Write the saved state into `engine` (any world size and layout). FileNotFoundError / ValueError name the
    file or the parameter that is missing or wrong."""
    state = read_state_files(checkpoint_dir)
    rows, fields = state.rows, state.fields
    _ensure_zero_state(engine, {f for names in fields.values() for f in names})
    relink_optimizer_state(engine.optimizer)
    with torch.no_grad():
        for key, piece, _ in _keyed_parameters(engine):
            p = piece[0]
            if key not in rows:
                raise ValueError(f"portable state: no saved state for parameter {key} in {checkpoint_dir}")
            io = ExpertStateIO(engine, p)
            _ensure_torch_state(io, p, fields[key])
            io = ExpertStateIO(engine, p)
            if io.fields_of(piece) != fields[key]:
                raise ValueError(f"portable state: {key} was saved with {fields[key]}, "
                                 f"this optimizer has {io.fields_of(piece)}")
            if rows[key].numel() != io.row_size([piece]):
                raise ValueError(f"portable state: {key} has {rows[key].numel()} saved values in {checkpoint_dir}, "
                                 f"this parameter's {fields[key]} need {io.row_size([piece])}")
            io.write([piece], rows[key].to(p.device))
    _restore_group_steps(engine, state.group_steps)
    engine.global_steps = state.global_steps


# ------------------------------------------------------------------------------------------------ files
@dataclass(frozen=True, kw_only=True)
class PortableState:
    """What a checkpoint directory's portable state holds, merged over its ranks' files."""

    rows: dict[str, torch.Tensor]  # key -> `[F]` float32: the key's fields concatenated
    fields: dict[str, list[str]]  # key -> field names, in row order
    group_steps: list[float]  # rank 0's: step count per flat ZeRO partition
    global_steps: int  # rank 0's


def _names(rank: int) -> tuple[str, str]:
    return f"cobalt_state_rank{rank}.safetensors", f"cobalt_state_rank{rank}.json"


def _state_files(directory: str) -> dict[str, dict[int, str]]:
    """kind ("json", "safetensors", "pt") -> rank -> path of the portable-state files in `directory`."""
    found: dict[str, dict[int, str]] = {"json": {}, "safetensors": {}, "pt": {}}
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = _FILE.fullmatch(name)
            if match:
                found[match["kind"]][int(match["rank"])] = os.path.join(directory, name)
    return found


def _shared_save_id() -> str:
    """A random id, the same on every rank (rank 0's), that ties the files of one save together."""
    ids = [uuid.uuid4().hex]
    if _world_size() > 1:
        dist.broadcast_object_list(ids, src=0)  # our own ranks' data, not a user file
    return ids[0]


def write_state_files(directory: str, *, rank: int, world_size: int, save_id: str, rows: dict[str, torch.Tensor],
                      fields: dict[str, list[str]], group_steps: list[float], global_steps: int) -> str:
    """Write one rank's `cobalt_state_rank{rank}.safetensors` + `.json` (module docstring); returns the manifest's
    path. `rows[key]` is a 1-D float32 tensor; `fields` has the same keys."""
    assert set(rows) == set(fields), sorted(set(rows) ^ set(fields))
    os.makedirs(directory, exist_ok=True)
    tensors_name, manifest_name = _names(rank)
    tensors_path, manifest_path = os.path.join(directory, tensors_name), os.path.join(directory, manifest_name)
    tensors = {key: row.detach().cpu().contiguous() for key, row in rows.items()}
    write_atomically(tensors_path, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT,
                                                                                  "save_id": save_id}))
    manifest = {"format": FORMAT, "rank": rank, "world_size": world_size, "save_id": save_id,
                "tensors": tensors_name, "tensors_bytes": os.path.getsize(tensors_path),
                "keys": list(rows), "fields": {key: list(fields[key]) for key in rows},
                "group_steps": [float(s) for s in group_steps], "global_steps": int(global_steps)}
    text = json.dumps(manifest, allow_nan=False)
    write_text_atomically(manifest_path, text)
    return manifest_path


def read_state_files(directory: str) -> PortableState:
    """Read a checkpoint directory's portable state (v2; else the old `.pt` files, safely) without unpickling."""
    files = _state_files(directory)
    if files["json"] or files["safetensors"]:
        return _read_v2(directory, files)
    if files["pt"]:
        return _read_v1(directory, files["pt"])
    raise FileNotFoundError(f"portable state: no cobalt_state_rank*.json / .safetensors in {directory}")


def _read_v2(directory: str, files: dict[str, dict[int, str]]) -> PortableState:
    first = _read_manifest(directory, 0, "rank 0's manifest gives the world size and the save id"
                           + (" (its tensors file is there: an interrupted save, or the manifest was removed)"
                              if 0 in files["safetensors"] else ""))
    first_path = os.path.join(directory, _names(0)[1])
    rows: dict[str, torch.Tensor] = {}
    fields: dict[str, list[str]] = {}
    for rank in range(first["world_size"]):
        manifest = first if rank == 0 else _read_manifest(
            directory, rank, f"{first_path} says the save had {first['world_size']} ranks")
        path = os.path.join(directory, _names(rank)[1])
        if (manifest["world_size"], manifest["save_id"]) != (first["world_size"], first["save_id"]):
            raise ValueError(f"portable state: {path} is from another save than {first_path} (world size "
                             f"{manifest['world_size']} vs {first['world_size']}, save id {manifest['save_id']} vs "
                             f"{first['save_id']}): the directory mixes two saves, e.g. after an interrupted one")
        rows.update(_read_tensors(directory, manifest, path))
        fields.update(manifest["fields"])
    return PortableState(rows=rows, fields=fields, group_steps=first["group_steps"],
                         global_steps=first["global_steps"])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_fields(data: dict, path: str, checks: dict[str, tuple[Any, str]]) -> None:
    for name, (ok, what) in checks.items():
        if name not in data:
            raise ValueError(f"portable state: {path} has no {name!r} (expected {what})")
        if not ok(data[name]):
            raise ValueError(f"portable state: {path}: {name!r} must be {what}, got {data[name]!r:.200}")


def _read_manifest(directory: str, rank: int, why: str) -> dict:
    tensors_name, name = _names(rank)
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"portable state: manifest {path} is missing ({why})")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"portable state: {path} is not a JSON manifest ({err}): truncated, or not written "
                         f"by ds_cobalt") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise ValueError(f"portable state: {path} is not a ds_cobalt portable-state manifest (format {found!r}, "
                         f"expected {FORMAT!r})")
    _check_fields(data, path, {
        "rank": (lambda v: v == rank and is_json_int(v), f"{rank}, the rank in the file name"),
        "world_size": (lambda v: is_json_int(v) and v > rank, f"an int > {rank}"),
        "save_id": (lambda v: isinstance(v, str), "a string"),
        "tensors": (lambda v: v == tensors_name, repr(tensors_name)),
        "tensors_bytes": (lambda v: is_json_int(v) and v >= 0, "an int >= 0"),
        "keys": (lambda v: _is_str_list(v) and len(set(v)) == len(v), "a list of distinct strings"),
        "fields": (lambda v: isinstance(v, dict) and set(v) == set(data["keys"])
                   and all(_is_str_list(f) for f in v.values()), "{key: [field, ...]} for every key in 'keys'"),
        "group_steps": (lambda v: isinstance(v, list) and all(_is_number(s) for s in v), "a list of numbers"),
        "global_steps": (lambda v: is_json_int(v) and v >= 0, "an int >= 0"),
    })
    data["group_steps"] = [float(s) for s in data["group_steps"]]
    return data


def _read_tensors(directory: str, manifest: dict, manifest_path: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, manifest["tensors"])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"portable state: tensors file {path} is missing (listed by {manifest_path})")
    size = os.path.getsize(path)
    if size != manifest["tensors_bytes"]:
        raise ValueError(f"portable state: {path} has {size} bytes, its manifest {manifest_path} says "
                         f"{manifest['tensors_bytes']}: truncated, or written by another save")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("save_id") != manifest["save_id"]:
                raise ValueError(f"portable state: {path} is not the tensors file of {manifest_path} (its header "
                                 f"says format {meta.get('format')!r}, save id {meta.get('save_id')!r}; expected "
                                 f"{FORMAT!r}, {manifest['save_id']!r})")
            if set(f.keys()) != set(manifest["keys"]):
                diff = sorted(set(f.keys()) ^ set(manifest["keys"]))
                raise ValueError(f"portable state: {path} and {manifest_path} list different tensors: {diff[:5]}")
            tensors = {key: f.get_tensor(key) for key in manifest["keys"]}
    except SafetensorError as err:
        raise ValueError(f"portable state: {path} is not a readable safetensors file ({err})") from None
    for key, t in tensors.items():
        if t.dtype != torch.float32 or t.dim() != 1:
            raise ValueError(f"portable state: {path}: {key} must be a 1-D float32 tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    return tensors


def _read_v1(directory: str, files: dict[int, str]) -> PortableState:
    """The old `torch.save` files, through torch's restricted unpickler only (tensors and plain containers)."""
    if torch.__version__ < "2.6":
        raise ValueError(f"portable state: {directory} holds the old pickle-based format ({LEGACY_FORMAT}, "
                         f"cobalt_state_rank*.pt); reading it safely (torch.load(weights_only=True)) needs "
                         f"torch >= 2.6, this is {torch.__version__}. {_LEGACY_HOWTO}")
    rows: dict[str, torch.Tensor] = {}
    fields: dict[str, list[str]] = {}
    saved = None
    for path in sorted(files.values()):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - UnpicklingError (forbidden object), RuntimeError/EOFError (bad file)
            lines = [ln for ln in str(err).splitlines() if "WeightsUnpickler error" in ln]
            reason = lines[0].strip() if lines else f"{type(err).__name__}: {str(err)[:200]}"
            raise ValueError(f"portable state: {path} is the old pickle-based format ({LEGACY_FORMAT}) and holds "
                             f"more than tensors and plain containers, or is damaged, so it is not loaded "
                             f"({reason}). Unpickling it could run code. {_LEGACY_HOWTO}") from None
        if not isinstance(payload, dict) or payload.get("format") != LEGACY_FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(f"portable state: {path} is not a ds_cobalt portable-state file (format {found!r}, "
                             f"expected {LEGACY_FORMAT!r})")
        _check_fields(payload, path, {
            "rank": (is_json_int, "an int"),
            "rows": (lambda v: isinstance(v, dict) and all(
                isinstance(k, str) and torch.is_tensor(t) and t.dtype == torch.float32 and t.dim() == 1
                for k, t in v.items()), "{key: 1-D float32 tensor}"),
            "fields": (lambda v, payload=payload: isinstance(v, dict) and set(v) == set(payload["rows"])
                       and all(_is_str_list(f) for f in v.values()), "{key: [field, ...]} for every row"),
            "group_steps": (lambda v: isinstance(v, list) and all(_is_number(s) for s in v), "a list of numbers"),
            "global_steps": (is_json_int, "an int"),
        })
        rows.update(payload["rows"])
        fields.update(payload["fields"])
        if payload["rank"] == 0:
            saved = payload
    if saved is None:
        raise FileNotFoundError(f"portable state: rank 0's file cobalt_state_rank0.pt is missing in {directory}")
    logger.warning(f"ds_cobalt: read the old portable-state format ({LEGACY_FORMAT}, .pt) in {directory} through "
                   f"torch.load(weights_only=True); the next save_checkpoint writes {FORMAT}")
    return PortableState(rows=rows, fields=fields, group_steps=[float(s) for s in saved["group_steps"]],
                         global_steps=saved["global_steps"])


_LEGACY_HOWTO = ("To convert a checkpoint you trust: resume it at the world size that saved it with "
                 "engine.load_checkpoint(dir, tag) (DeepSpeed's own optimizer files, no portable state), then "
                 "save_checkpoint writes the safe format (cobalt_state_rank*.safetensors + .json). Or delete the "
                 "cobalt_state_rank*.pt files to resume the weights only (load_module_only=True then restores no "
                 "optimizer state).")


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

