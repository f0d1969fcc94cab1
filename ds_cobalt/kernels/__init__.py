"""Dispatch/combine kernels behind a small interface: torch reference (`ref`, the spec) and CuPy backend.

See `ops` for the functions and `docs/kernels.md` for the ops, their memory traffic and status.
"""

from .flags import ChunkReadyFlags
from .ops import (
    Backend,
    auto_backend,
    chunk_ready_flags,
    cupy_install_hint,
    dedup_pairs,
    gather_rows,
    resolve_backend,
    weighted_scatter_add,
)
from .ref import accumulate_dtype

__all__ = [
    "Backend",
    "accumulate_dtype",
    "auto_backend",
    "ChunkReadyFlags",
    "chunk_ready_flags",
    "cupy_install_hint",
    "dedup_pairs",
    "gather_rows",
    "resolve_backend",
    "weighted_scatter_add",
]
