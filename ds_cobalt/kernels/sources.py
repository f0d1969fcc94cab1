"""Locate the CUDA sources: package data `ds_cobalt.cuda` when installed, the repo's `cuda/` in a checkout."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["cuda_source", "cuda_source_names"]

_CHECKOUT_DIR = Path(__file__).resolve().parents[2] / "cuda"


def cuda_source(name: str) -> str:
    """Text of `cuda/<name>` (e.g. "gather_rows.cu")."""
    try:
        return importlib.resources.files("ds_cobalt.cuda").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        # source checkout (or an editable install that does not map package-dir): the top-level cuda/
        return (_CHECKOUT_DIR / name).read_text()


def cuda_source_names() -> list[str]:
    """Names of the shipped `.cu` files."""
    try:
        root = importlib.resources.files("ds_cobalt.cuda")
        names = sorted(p.name for p in root.iterdir() if p.name.endswith(".cu"))
    except ModuleNotFoundError:
        names = []
    return names or sorted(p.name for p in _CHECKOUT_DIR.glob("*.cu"))
