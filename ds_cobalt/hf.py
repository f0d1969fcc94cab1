"""HuggingFace Trainer integration: `from ds_cobalt.hf import CobaltCallback` (needs the `hf` extra)."""

from __future__ import annotations

from .integrations.hf import CobaltCallback

__all__ = ["CobaltCallback"]
