"""Routing traces: the DESIGN.md `.npz` format (load, save, validate).

Legend: L MoE layers, T tokens, K experts per token (top-k), E logical experts, W ranks.

Fields:
- `experts`      `[L, T, K]` int, the top-k expert ids of token t in layer l, -1 = none (dropped).
- `num_experts`  int scalar.
- `source_rank`  optional `[T]` int, the global rank where token t lives (default: t * W // T).
- `weights`      optional `[L, T, K]` float, the gate weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .files import write_atomically

__all__ = ["Trace", "load_trace", "save_trace", "validate_trace", "default_source_rank"]


@dataclass(frozen=True)
class Trace:
    """A validated routing trace (see module docstring for the fields)."""

    experts_LTK: np.ndarray  # [L, T, K] int64, -1 = none
    num_experts: int
    source_rank_T: np.ndarray | None = None  # [T] int64
    weights_LTK: np.ndarray | None = None  # [L, T, K] float32

    def __post_init__(self) -> None:
        validate_trace(self.experts_LTK, self.num_experts, self.source_rank_T, self.weights_LTK)
        object.__setattr__(self, "experts_LTK", np.asarray(self.experts_LTK, dtype=np.int64))
        object.__setattr__(self, "num_experts", int(self.num_experts))
        if self.source_rank_T is not None:
            object.__setattr__(self, "source_rank_T", np.asarray(self.source_rank_T, dtype=np.int64))
        if self.weights_LTK is not None:
            object.__setattr__(self, "weights_LTK", np.asarray(self.weights_LTK, dtype=np.float32))

    @property
    def num_layers(self) -> int:
        return int(self.experts_LTK.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.experts_LTK.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts_LTK.shape[2])

    def source_ranks(self, world_size: int) -> np.ndarray:
        """`[T]` int64 source rank of every token for a run on `world_size` ranks."""
        if self.source_rank_T is None:
            return default_source_rank(self.num_tokens, world_size)
        if self.num_tokens and int(self.source_rank_T.max()) >= world_size:
            raise ValueError(
                f"trace: source_rank holds rank {int(self.source_rank_T.max())}, "
                f"but the layout has only {world_size} ranks"
            )
        return self.source_rank_T

    def select_tokens(self, index_T: np.ndarray | slice) -> "Trace":
        """A trace over a subset of the tokens (same layers)."""
        return Trace(
            self.experts_LTK[:, index_T],
            self.num_experts,
            None if self.source_rank_T is None else self.source_rank_T[index_T],
            None if self.weights_LTK is None else self.weights_LTK[:, index_T],
        )


def default_source_rank(num_tokens: int, world_size: int) -> np.ndarray:
    """`[T]` DESIGN.md default: tokens split into W contiguous blocks, token t on rank t * W // T."""
    if num_tokens == 0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(num_tokens, dtype=np.int64) * world_size // num_tokens


def validate_trace(
    experts_LTK: np.ndarray,
    num_experts: object,
    source_rank_T: np.ndarray | None = None,
    weights_LTK: np.ndarray | None = None,
) -> None:
    """Raise ValueError naming the bad field of a trace."""
    experts = np.asarray(experts_LTK)
    if isinstance(num_experts, np.ndarray):
        if num_experts.ndim != 0:
            raise ValueError(f"trace: 'num_experts' must be a scalar, got shape {num_experts.shape}")
        num_experts = num_experts.item()
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise ValueError(f"trace: 'num_experts' must be a positive integer, got {num_experts!r}")
    if not np.issubdtype(experts.dtype, np.integer):
        raise ValueError(f"trace: 'experts' must be an integer array, got dtype {experts.dtype}")
    if experts.ndim != 3:
        raise ValueError(f"trace: 'experts' must have shape [L, T, K] (3 dims), got shape {experts.shape}")
    if experts.shape[0] < 1:
        raise ValueError("trace: 'experts' has no layers (L = 0)")
    if experts.shape[2] < 1:
        raise ValueError("trace: 'experts' has K = 0 experts per token")
    bad = (experts < -1) | (experts >= num_experts)
    if bad.any():
        layer, token, k = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(
            f"trace: 'experts' holds id {int(experts[layer, token, k])} at layer {layer} token {token} "
            f"slot {k}, outside [0, num_experts={num_experts}) and not -1"
        )
    L, T, K = experts.shape
    if source_rank_T is not None:
        src = np.asarray(source_rank_T)
        if not np.issubdtype(src.dtype, np.integer):
            raise ValueError(f"trace: 'source_rank' must be an integer array, got dtype {src.dtype}")
        if src.shape != (T,):
            raise ValueError(f"trace: 'source_rank' must have shape [T] = ({T},), got {src.shape}")
        if T and int(src.min()) < 0:
            raise ValueError(f"trace: 'source_rank' holds negative rank {int(src.min())}")
    if weights_LTK is not None:
        w = np.asarray(weights_LTK)
        if not np.issubdtype(w.dtype, np.floating):
            raise ValueError(f"trace: 'weights' must be a float array, got dtype {w.dtype}")
        if w.shape != experts.shape:
            raise ValueError(f"trace: 'weights' must have the shape of 'experts' {experts.shape}, got {w.shape}")
        if not np.isfinite(w).all():
            raise ValueError("trace: 'weights' holds NaN or infinite values")


def load_trace(path: str | Path) -> Trace:
    """Read a trace `.npz`; errors name the file and the bad field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace {path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(6)
    if not magic.startswith((b"PK", b"\x93NUMPY")):  # a zip archive (.npz) or a numpy array file
        raise ValueError(f"trace {path}: not a readable .npz file (not an .npz archive: it starts with {magic!r})")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - np.load raises many types for a bad file
        raise ValueError(f"trace {path}: not a readable .npz file ({err})") from err
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"trace {path}: a single array (.npy), not an .npz archive with the fields 'experts' and "
                         "'num_experts'")
    with data:
        for key in ("experts", "num_experts"):
            if key not in data.files:
                raise ValueError(f"trace {path}: missing field {key!r} (has {sorted(data.files)})")
        fields: dict[str, np.ndarray] = {}
        for key in data.files:
            try:
                fields[key] = data[key]
            except Exception as err:  # noqa: BLE001 - ValueError for an object array (a pickle: refused), zip errors
                raise ValueError(f"trace {path}: cannot read field {key!r} ({err}); a trace holds numeric "
                                 f"arrays only, object arrays (pickles) are never loaded") from None
    try:
        return Trace(
            fields["experts"],
            fields["num_experts"],
            fields.get("source_rank"),
            fields.get("weights"),
        )
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace `.npz` (compressed) in the DESIGN.md format (atomically: `files.write_atomically`)."""
    fields: dict[str, np.ndarray] = {
        "experts": trace.experts_LTK.astype(np.int32 if trace.num_experts < 2**31 else np.int64),
        "num_experts": np.asarray(trace.num_experts, dtype=np.int64),
    }
    if trace.source_rank_T is not None:
        fields["source_rank"] = trace.source_rank_T
    if trace.weights_LTK is not None:
        fields["weights"] = trace.weights_LTK
    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            np.savez_compressed(fh, **fields)

    write_atomically(path, write)
