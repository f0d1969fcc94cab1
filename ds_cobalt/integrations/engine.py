"""`ds_cobalt.initialize`: `deepspeed.initialize` plus the `"cobalt"` config section, ending with a `CobaltEngine`."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import deepspeed
import torch

from ..config import CobaltConfig, split_deepspeed_config
from . import peer_watch
from .auto_ep import adopt_auto_ep_layers
from .cobalt_engine import CobaltEngine
from .layers import cobalt_layers, layer_cores, traffic_summary

__all__ = ["initialize", "cobalt_layers", "layer_cores", "traffic_summary", "configure_layers", "CobaltEngine"]


def configure_layers(model: torch.nn.Module, config: CobaltConfig) -> int:
    """Apply `config` to every `ds_cobalt.MoE` of `model` (before its process groups exist); returns how many."""
    layers = [layer for layer in cobalt_layers(model) if hasattr(layer, "configure_cobalt")]
    for layer in layers:
        layer.configure_cobalt(config)
    return len(layers)


def _check_model_parameters(model_parameters: Any, model: torch.nn.Module) -> None:
    """ValueError where `model_parameters` is a list of param groups that hold no parameter at all while the model
    has trainable ones: typically `split_params_into_different_moe_groups_for_optimizer({"params":
    model.parameters(), ...})`, whose generator the helper uses up, so that DeepSpeed builds an optimizer that
    trains nothing (ZeRO 0) or fails on the missing MoE group (ZeRO 1/2)."""
    if not isinstance(model_parameters, (list, tuple)) or not model_parameters:
        return
    if not all(isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in model_parameters):
        return  # plain parameters, or groups whose params are not read here (a generator would be used up)
    if all(len(g["params"]) == 0 for g in model_parameters) and any(
            p.requires_grad for p in model.parameters()):
        raise ValueError("ds_cobalt.initialize: model_parameters holds no parameter in any group; pass a list of "
                         "parameters (e.g. {'params': list(model.parameters()), 'name': 'p'}): a generator, such as "
                         "model.parameters(), is used up by split_params_into_different_moe_groups_for_optimizer")


def initialize(args: argparse.Namespace | None = None, model: torch.nn.Module | None = None,
               config: str | Path | dict | None = None, **kwargs: Any):
    """Like `deepspeed.initialize`, and returns the same tuple; the config may carry a `"cobalt"` section.

    The section is validated (errors name the bad key), applied to every ds_cobalt MoE layer of
    `model`, and removed before DeepSpeed sees the config. AutoEP layers are converted to ds_cobalt's
    dispatcher; an engine with ds_cobalt layers is returned as a `CobaltEngine` (a `DeepSpeedEngine`).
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
    _check_model_parameters(kwargs.get("model_parameters"), model)
    configure_layers(model, cobalt)
    result = deepspeed.initialize(args=args, model=model, config=ds_config, **kwargs)
    peer_watch.install()  # a failing rank names the peers that died first
    engine = result[0]
    if ds_config.get("expert_parallel", {}).get("enabled"):  # AutoEP replaced the MoE blocks just now
        adopt_auto_ep_layers(engine, cobalt)
    if layer_cores(engine):
        CobaltEngine.adopt(engine, cobalt)
    else:
        engine.cobalt_config = cobalt
    return result
