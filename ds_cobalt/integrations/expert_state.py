"""Full training state of expert parameters as flat fp32 rows (what migration and portable state move).

A *piece* is `(parameter, row)`: a whole parameter (`row=None`, one expert module's weight as in
`ds_cobalt.MoE`) or one row of a fused expert tensor (`row=e` of AutoEP's `[E_local, ...]` `w1/w2/w3`).
Per piece a row holds, in order: the model weight, the fp32 master copy (when distinct from the weight),
the optimizer moments (e.g. Adam's `exp_avg`, `exp_avg_sq`) and, for whole parameters where the optimizer
keeps one, its `step` (a fused tensor has one step for all its rows, equal on every rank).

Access goes through DeepSpeed's tensor-fragment API (`safe_get/set_full_fp32_param`,
`safe_get/set_full_optimizer_state`) under ZeRO-1/2 and DeepSpeed's bf16 optimizer, through the unfused
optimizer's fp32 copies for bf16/fp16 without ZeRO, and through the torch optimizer state for fp32 without
ZeRO. Fragment reads are collectives of the parameter's data-parallel group: every rank of that group
must read the same pieces in the same order (they do: they share the EP rank, hence the plan).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

Piece = tuple[torch.nn.Parameter, "int | None"]

__all__ = ["Piece", "ExpertStateIO", "piece_numel", "relink_optimizer_state"]


def relink_optimizer_state(optimizer: Any) -> bool:
    """Re-link ZeRO-1/2's per-parameter optimizer-state fragments (DESIGN.md pitfall).

    DeepSpeed 0.19.8 links the fragments once, right after the first param group's first step, so
    groups stepped later (the expert groups) keep an empty link, and a `load_state_dict` replaces the
    state tensors behind the links. Re-linking reads `optimizer.state` afresh. Returns True when the
    optimizer has such links (private attributes, pinned by tests/integrations/test_migration.py).
    """
    if not (hasattr(optimizer, "_hp_optimizer_states_linked")
            and hasattr(optimizer, "_lazy_init_hp_params_optimizer_state")):
        return False
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
    return True


class ExpertStateIO:
    """Reads/writes pieces' training state. `fields` (identical on every rank: they depend on the optimizer
    and on whether it has stepped) are those of a whole parameter; `fields_of(piece)` drops `step` for rows."""

    def __init__(self, engine: Any, reference: torch.nn.Parameter) -> None:
        opt = engine.optimizer
        self.optimizer = opt
        self.has_step = False
        if hasattr(reference, "_hp_mapping"):
            self.mode = "fragment"  # ZeRO-1/2, DeepSpeed's bf16 optimizer
            relink_optimizer_state(opt)
            # Keys from the flat partitions' state (every rank holds some), not from this parameter's
            # fragment, which is absent on ranks whose partition does not cover it.
            inner = getattr(opt, "optimizer", opt)
            self.moment_keys = sorted({k for st in inner.state.values() for k, v in st.items()
                                       if torch.is_tensor(v) and v.dim() > 0})
            self.fields = ["weight", "fp32", *self.moment_keys]
            return
        if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
            self.mode = "unfused"  # fp16/bf16 without ZeRO: one fp32 copy per parameter
            self._master = {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups)
                            for lp, hp in zip(lps, hps)}
            self._state = opt.optimizer.state
            master = self._master[id(reference)]
            fields = ["weight", "fp32"]
        elif isinstance(opt, torch.optim.Optimizer):
            self.mode = "torch"  # fp32 without ZeRO: the model parameter is the master copy
            self._master = None
            self._state = opt.state
            master = reference
            fields = ["weight"]
        else:
            raise TypeError(f"ds_cobalt expert state: unsupported optimizer {type(opt).__name__}")
        state = self._state.get(master, {})
        self.moment_keys = sorted(k for k, v in state.items()
                                  if torch.is_tensor(v) and v.shape == master.shape and k != "step")
        self.has_step = "step" in state
        self.fields = fields + self.moment_keys + (["step"] if self.has_step else [])

    def fields_of(self, piece: Piece) -> list[str]:
        return self.fields if piece[1] is None else [f for f in self.fields if f != "step"]

    def row_size(self, pieces: Sequence[Piece]) -> int:
        return sum(1 if f == "step" else piece_numel(piece) for piece in pieces for f in self.fields_of(piece))

    def _master_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        return p if self._master is None else self._master[id(p)]

    # ----- reads -----
    def read(self, pieces: Sequence[Piece]) -> torch.Tensor:
        """One flat fp32 row: for each piece, its fields in order."""
        return self.read_rows([pieces])[0]

    def read_rows(self, experts: Sequence[Sequence[Piece]]) -> torch.Tensor:
        """`[len(experts), F]`: one row per expert. A fused tensor's full state is read once per call; under ZeRO
        every partitioned field of the call in one all-reduce per data-parallel group (`_read_fragments`)."""
        cache: dict[tuple[int, str], torch.Tensor] = {}
        if self.mode == "fragment":
            wanted = {(id(p), field): (p, field) for pieces in experts for p, row in pieces
                      for field in self.fields_of((p, row)) if field != "weight"}
            cache.update(_read_fragments(list(wanted.values())))
        rows = []
        for pieces in experts:
            parts = [self._read_piece(piece, field, cache).reshape(-1).float()
                     for piece in pieces for field in self.fields_of(piece)]
            rows.append(torch.cat(parts))
        if not rows:
            return torch.zeros((0, 0))
        return torch.stack(rows)

    def _read_piece(self, piece: Piece, field: str, cache: dict) -> torch.Tensor:
        p, row = piece
        key = (id(p), field)
        if key not in cache:
            if row is None:
                return self._read(p, field)
            cache[key] = self._read(p, field)
        return cache[key] if row is None else cache[key][row]

    def _read(self, p: torch.nn.Parameter, field: str) -> torch.Tensor:
        if field == "weight":
            return p.detach()
        if self.mode == "fragment":
            if field == "fp32":
                return safe_get_full_fp32_param(p)
            return safe_get_full_optimizer_state(p, field)
        master = self._master_of(p)
        if field == "fp32":
            return master.detach()
        value = self._state[master][field]
        return value if torch.is_tensor(value) else torch.tensor([float(value)])

    # ----- writes -----
    def write(self, pieces: Sequence[Piece], row: torch.Tensor) -> None:
        self.write_rows([pieces], row[None])

    def write_rows(self, experts: Sequence[Sequence[Piece]], rows: torch.Tensor) -> None:
        """Inverse of `read_rows`. Under ZeRO a fused tensor's fields are read, patched and set once."""
        patched: dict[tuple[int, str], tuple[torch.nn.Parameter, str, torch.Tensor]] = {}
        for pieces, flat in zip(experts, rows):
            offset = 0
            for piece in pieces:
                for field in self.fields_of(piece):
                    n = 1 if field == "step" else piece_numel(piece)
                    self._write_piece(piece, field, flat[offset: offset + n], patched)
                    offset += n
            assert offset == flat.numel(), (offset, flat.numel())
        for p, field, full in patched.values():
            self._set_fragment(p, field, full)

    def _write_piece(self, piece: Piece, field: str, flat: torch.Tensor, patched: dict) -> None:
        p, row = piece
        if row is None:
            if self.mode == "fragment" and field != "weight":
                self._set_fragment(p, field, flat.view(p.shape))
            else:
                self._write_local(p, field, flat, lambda t: t)
            return
        if self.mode == "fragment" and field != "weight":
            key = (id(p), field)
            if key not in patched:
                patched[key] = (p, field, self._read(p, field))  # a fresh full copy (all-reduced)
            patched[key][2][row].copy_(flat.view(p.shape[1:]))
            return
        self._write_local(p, field, flat, lambda t: t[row])

    def _set_fragment(self, p: torch.nn.Parameter, field: str, full: torch.Tensor) -> None:
        if field == "fp32":
            safe_set_full_fp32_param(p, full)
        else:
            safe_set_full_optimizer_state(p, full, field)

    def _write_local(self, p: torch.nn.Parameter, field: str, flat: torch.Tensor, select) -> None:
        """Writes that touch only this rank's tensors: the weight, and master/moments without ZeRO."""
        if field == "weight":
            target = select(p.data)  # also the model copy, not only the master
            target.copy_(flat.view_as(target).to(p.dtype))
            return
        master = self._master_of(p)
        if field == "fp32":
            target = select(master.data)
            target.copy_(flat.view_as(target))
            return
        state = self._state[master]
        if field == "step" and not torch.is_tensor(state["step"]):
            state["step"] = type(state["step"])(flat.item())
            return
        target = select(state[field])
        target.copy_(flat.view_as(target).to(target.dtype))


def _read_fragments(fields: Sequence[tuple[torch.nn.Parameter, str]]) -> dict[tuple[int, str], torch.Tensor]:
    """`(id(p), field) -> ` the full fp32 value of each ZeRO-1/2 (or bf16 optimizer) partitioned field ("fp32" or an
    optimizer moment), as `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` assemble it (each rank's
    fragment at its place, zeros elsewhere, summed over the parameter's data-parallel group), in one all-reduce
    per group instead of one per parameter and field (a migration of 26 experts here ran 168). Collective: every
    rank of a group passes the same parameters and fields in the same order."""
    by_group: dict[int, list[tuple[torch.nn.Parameter, str]]] = {}
    groups: dict[int, Any] = {}
    for p, field in fields:
        group = p._dp_group  # as DeepSpeed's `get_full_hp_param` reduces it
        by_group.setdefault(id(group), []).append((p, field))
        groups[id(group)] = group
    out: dict[tuple[int, str], torch.Tensor] = {}
    for key, members in by_group.items():
        starts = np.cumsum([0] + [p.numel() for p, _ in members]).tolist()
        flat = torch.zeros(starts[-1], dtype=torch.float32, device=members[0][0].device)
        with torch.no_grad():
            for (p, field), start in zip(members, starts):
                mapping = p._hp_mapping
                if mapping is None:  # this rank's partition holds none of it
                    continue
                address = mapping.lp_fragment_address
                fragment = mapping.get_hp_fragment(None if field == "fp32" else field)
                flat.narrow(0, start + address.start, address.numel).copy_(fragment.reshape(-1))
        if dist.is_initialized():
            dist.all_reduce(flat, group=groups[key])
        for (p, field), start in zip(members, starts):
            out[(id(p), field)] = flat.narrow(0, start, p.numel()).view(p.shape)
    return out


def piece_numel(piece: Piece) -> int:
    """Elements of a piece's weight: the whole parameter, or one row of it."""
    p, row = piece
    return p.numel() if row is None else p[0].numel()
