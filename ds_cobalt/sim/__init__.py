"""Numpy simulator: synthetic traces, layout metrics, step-by-step replay, plots (no torch import)."""

from .metrics import METRICS, layer_metrics, simulate
from .replay import replay
from .synth import gini, synth_trace

__all__ = ["METRICS", "layer_metrics", "simulate", "replay", "gini", "synth_trace"]
