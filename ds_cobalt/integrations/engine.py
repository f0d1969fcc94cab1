"""`ds_cobalt.initialize`: `deepspeed.initialize` plus the `"cobalt"` config section."""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path
from typing import Any, Callable

import deepspeed
import torch
from deepspeed.utils import logger

from ..config import CobaltConfig, split_deepspeed_config
from ..runtime.traffic import sum_totals
from .deepspeed_moe import MoE


_LAYER_TYPES: tuple[type, ...] = (MoE,)


def register_layer_type(cls: type) -> type:
    """Make `cobalt_layers` (traffic, stats, step hooks) see another ds_cobalt layer class (e.g. AutoEP's)."""
    global _LAYER_TYPES
    if cls not in _LAYER_TYPES:
        _LAYER_TYPES = (*_LAYER_TYPES, cls)
    return cls


def cobalt_layers(model: torch.nn.Module) -> list[MoE]:
    """The ds_cobalt MoE layers of a model (or of a DeepSpeed engine's module), in module order."""
    module = getattr(model, "module", model)
    return [m for m in module.modules() if isinstance(m, _LAYER_TYPES)]


def traffic_summary(model: torch.nn.Module) -> dict[str, int]:
    """Cumulative traffic of this rank over all ds_cobalt layers: bytes/rows sent inter- and intra-node,
    and what DeepSpeed's all-to-all would have sent inter-node for the same forwards (padded E x C
    buffers, and the dropless one row per (token, expert))."""
    return sum_totals([layer.traffic for layer in cobalt_layers(model)])


def initialize(args: argparse.Namespace | None = None, model: torch.nn.Module | None = None,
               config: str | Path | dict | None = None, **kwargs: Any):
    """Like `deepspeed.initialize`, and returns the same tuple; the config may carry a `"cobalt"` section.

    The section is validated (errors name the bad key), applied to every ds_cobalt MoE layer of
    `model`, and removed before DeepSpeed sees the config.
    """
    if model is None:
        raise ValueError("ds_cobalt.initialize: model is required")
    config = kwargs.pop("config_params", None) if config is None else config
    if config is None and args is not None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ValueError("ds_cobalt.initialize: pass config=<path or dict> or args.deepspeed_config")
    ds_config, cobalt = split_deepspeed_config(config)
    layers = cobalt_layers(model)
    for layer in layers:
        layer.configure_cobalt(cobalt)
    result = deepspeed.initialize(args=args, model=model, config=ds_config, **kwargs)
    engine = result[0]
    engine.cobalt_config = cobalt
    if ds_config.get("expert_parallel", {}).get("enabled"):  # AutoEP replaced the MoE blocks just now
        from .auto_ep import adopt_auto_ep_layers

        layers = [*layers, *adopt_auto_ep_layers(engine, cobalt)]
    if layers:
        _install_step_hooks(engine, _step_hooks(engine, cobalt))
    return result


StepHook = Callable[[Any], None]


def _step_hooks(engine, cobalt: CobaltConfig) -> list[StepHook]:
    """The work ds_cobalt does after each optimizer step, as configured."""
    hooks: list[StepHook] = []
    if cobalt.traffic.log_interval:
        hooks.append(functools.partial(_log_traffic, interval=cobalt.traffic.log_interval))
    if cobalt.trace.path:
        from .trace import save_trace, start_trace, stop_trace

        first, last = cobalt.trace.start_step, cobalt.trace.start_step + cobalt.trace.steps
        if first == 0:
            start_trace(engine)

        def trace_hook(engine) -> None:
            if engine.global_steps == first:
                start_trace(engine)
            elif engine.global_steps == last:
                save_trace(engine, cobalt.trace.path)
                stop_trace(engine)
                if engine.global_rank == 0:
                    logger.info(f"ds_cobalt: wrote the routing of steps [{first}, {last}) to {cobalt.trace.path}")

        hooks.append(trace_hook)
    if cobalt.migration.checkpoint_logical_order:
        from .checkpoint import install_checkpoint_hooks

        install_checkpoint_hooks(engine, cobalt.migration.checkpoint_portable_state)  # not a step hook: wraps save/load_checkpoint (logical expert order)
    if cobalt.planner.replan_interval:
        from .replan import Replanner

        hooks.append(Replanner(engine, cobalt))
    return hooks


def _install_step_hooks(engine, hooks: list[StepHook]) -> None:
    """Run `hooks` after every `engine.step()` (only at gradient-accumulation boundaries)."""
    if not hooks:
        return
    step = engine.step

    @functools.wraps(step)
    def step_then_hooks(*args: Any, **kwargs: Any):
        boundary = engine.is_gradient_accumulation_boundary()
        out = step(*args, **kwargs)
        if boundary:
            for hook in hooks:
                hook(engine)
        return out

    engine.step = step_then_hooks


def _log_traffic(engine, interval: int) -> None:
    if engine.global_steps % interval or engine.global_rank != 0:
        return
    totals = traffic_summary(engine)
    # AutoEP layers pad nothing: compare with the dropless all-to-all there.
    kind = "padded" if totals["deepspeed_inter_node_bytes_padded"] else "dropless"
    ratio = totals["inter_node_bytes"] / max(1, totals[f"deepspeed_inter_node_bytes_{kind}"])
    logger.info(f"ds_cobalt step {engine.global_steps}: inter-node {totals['inter_node_bytes']} B "
                f"({ratio:.3f}x DeepSpeed's {kind} all-to-all), intra-node {totals['intra_node_bytes']} B")
