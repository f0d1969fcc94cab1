"""HuggingFace Trainer glue: `CobaltCallback`.

    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds_config.json"),
                      train_dataset=ds, callbacks=[CobaltCallback()])

The `"cobalt"` section stays in the DeepSpeed JSON: neither the Trainer's config handling (it only fills
`"auto"` values) nor DeepSpeed reads unknown top-level keys. The callback

- at `on_init_end` (before the Trainer builds the DeepSpeed engine): parses the section (errors name the key)
  and applies it to the model's `ds_cobalt.MoE` layers;
- at `on_train_begin` (the engine exists; with `"expert_parallel"` AutoEP has replaced the MoE blocks):
  converts the AutoEP layers to ds_cobalt's dispatcher (`auto_ep.adopt_auto_ep_layers`) and makes the engine
  a `CobaltEngine` (step hooks, checkpoints), as `ds_cobalt.initialize` does. On
  `trainer.train(resume_from_checkpoint=...)` the Trainer loads the DeepSpeed checkpoint before `on_train_begin`;
  the callback does the conversion right before that load instead (it wraps the Trainer's
  `deepspeed_load_checkpoint`), so the load restores ds_cobalt's layouts, optimizer state and re-planner state
  and the run continues exactly;
- wraps the Trainer's `save_model` (which its checkpoints call too) so that the module's state dict it writes holds
  the experts in logical order after migrations (`checkpoint.logical_order`);
- at `on_log` (training logging steps): adds `cobalt/*` metrics to the logs (so the printed logs,
  `state.log_history`, TensorBoard and other reporters get them): traffic since the previous logging step,
  summed over ranks, and expert load imbalance. Collective: every rank logs at the same steps, as the
  Trainer does.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import logger
from transformers import Trainer, TrainerCallback

from ..config import CobaltConfig, parse_cobalt_config, read_deepspeed_config, split_deepspeed_config
from . import peer_watch
from .auto_ep import adopt_auto_ep_layers
from .checkpoint import logical_order
from .cobalt_engine import CobaltEngine
from .engine import configure_layers
from .layers import SCHEDULES, layer_cores

PREFIX = "cobalt/"
_TRAFFIC_KEYS = (
    "inter_node_bytes",
    "intra_node_bytes",
    "deepspeed_inter_node_bytes_padded",
    "deepspeed_inter_node_bytes_dropless",
    "steps",
    "tokens",
)


class CobaltCallback(TrainerCallback):
    """Apply the `"cobalt"` config section to the engine the Trainer builds, and log ds_cobalt metrics.

    `config`: a `CobaltConfig`, a `"cobalt"` dict, or None to read the section from
    `TrainingArguments.deepspeed` (a path or dict; defaults when it has none).
    Metrics added to each training log (sums over ranks, over the steps since the previous log):
    `cobalt/inter_node_bytes`, `cobalt/intra_node_bytes`, `cobalt/baseline_inter_node_bytes` (what DeepSpeed
    would have sent across nodes: its padded E x C buffers for `ds_cobalt.MoE` layers, AutoEP's one row per
    (token, expert) for AutoEP layers), `cobalt/inter_node_vs_baseline` (ratio), `cobalt/tokens`, and
    `cobalt/expert_load_max_over_mean` (mean over layers of the busiest expert's load over the mean); with a
    DeepSpeed engine also `cobalt/migrations`, `cobalt/experts_moved` and `cobalt/migration_failures` (owner
    migrations by the replanner and around checkpoints, finished since the previous log). Not summed:
    `cobalt/layers_hierarchical`, `cobalt/layers_direct`, `cobalt/layers_dense` and `cobalt/layers_undecided`, the
    number of MoE layers on each transport schedule at the log (undecided: `auto` still timing them).
    """

    def __init__(self, config: CobaltConfig | dict | None = None) -> None:
        self._explicit = config
        self.config: CobaltConfig | None = None
        self._ds_config: dict = {}
        self._trainer: weakref.ReferenceType | None = None
        self._hooked_engine: int | None = None
        self._previous: torch.Tensor | None = None
        self._reports_seen = 0
        self._warned_no_layers = False

    # ----- Trainer events ------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs: Any) -> None:
        self._ds_config = _load_deepspeed_config(getattr(args, "deepspeed", None))
        self.config = self._resolve_config()
        trainer = _calling_trainer()
        if trainer is not None:
            self._trainer = weakref.ref(trainer)
            # run first, so the metrics this callback adds in on_log reach every reporter after it
            callbacks = trainer.callback_handler.callbacks
            callbacks.insert(0, callbacks.pop(callbacks.index(self)))
            _wrap_save_model(trainer, self)
        if model is not None:
            configure_layers(model, self.config)
        _wrap_trainer_checkpoint_load(self)

    def on_train_begin(self, args, state, control, model=None, **kwargs: Any) -> None:
        self._adopt(self._engine(), model)
        self._previous = None
        self._window(model)  # baseline for the first logging window

    def _adopt(self, engine: Any, model: Any) -> None:
        """Convert the AutoEP layers and make `engine` a `CobaltEngine` (idempotent per engine)."""
        config = self.config or self._resolve_config()
        target = engine if engine is not None else model
        stage = self._ds_config.get("zero_optimization", {}).get("stage")
        adopt_auto_ep_layers(
            target,
            config,
            zero_stage=stage if isinstance(stage, int) else None,
            expert_parallel=self._ds_config.get("expert_parallel", {}),
        )
        if engine is not None and self._hooked_engine != id(engine) and layer_cores(engine):
            CobaltEngine.adopt(engine, config)
            self._hooked_engine = id(engine)
        elif target is not None and not layer_cores(target) and not self._warned_no_layers:
            self._warned_no_layers = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.warning("ds_cobalt: CobaltCallback found no MoE layer to run (no ds_cobalt.MoE in the model, "
                               "and no AutoEP layers: AutoEP needs an \"expert_parallel\" section with \"enabled\": "
                               "true in the DeepSpeed config); the \"cobalt\" section has no effect")
        peer_watch.install()  # every rank runs on_train_begin: a failing rank names the peer that died first

    def on_train_end(self, args, state, control, **kwargs: Any) -> None:
        """Every rank: where `cobalt.trace`'s window is still open, write the steps it recorded (collective)."""
        engine = self._engine()
        if isinstance(engine, CobaltEngine):
            engine.save_cobalt_trace()

    def on_log(self, args, state, control, logs=None, model=None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs or model is None:  # only training logging steps (all ranks)
            return
        metrics = self.metrics(model)
        metrics.update(self._migration_metrics())
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    # ----- metrics -------------------------------------------------------------------------------
    def metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """ds_cobalt metrics since the previous call, summed over ranks (collective when distributed)."""
        layers = layer_cores(model)
        if not layers:
            return {}
        window = self._window(model)
        traffic, loads = (
            window[: len(_TRAFFIC_KEYS) * len(layers)],
            window[len(_TRAFFIC_KEYS) * len(layers) :],
        )
        per_layer = traffic.reshape(len(layers), len(_TRAFFIC_KEYS)).double()
        col = {key: per_layer[:, i] for i, key in enumerate(_TRAFFIC_KEYS)}
        padded, dropless = (
            col["deepspeed_inter_node_bytes_padded"],
            col["deepspeed_inter_node_bytes_dropless"],
        )
        baseline = float(torch.where(padded > 0, padded, dropless).sum())
        inter = float(col["inter_node_bytes"].sum())
        imbalance = []
        for load_E in loads.split([layer.stats.load_E.numel() for layer in layers]):
            mean = float(load_E.mean())
            if mean > 0:
                imbalance.append(float(load_E.max()) / mean)
        out = {
            f"{PREFIX}inter_node_bytes": inter,
            f"{PREFIX}intra_node_bytes": float(col["intra_node_bytes"].sum()),
            f"{PREFIX}baseline_inter_node_bytes": baseline,
            f"{PREFIX}inter_node_vs_baseline": inter / baseline if baseline else 0.0,
            f"{PREFIX}tokens": float(col["tokens"].sum()) / len(layers),
        }
        if imbalance:
            out[f"{PREFIX}expert_load_max_over_mean"] = sum(imbalance) / len(imbalance)
        for name in (*SCHEDULES, None):  # what `transport.schedule: "auto"` runs now (the same on every rank)
            out[f"{PREFIX}layers_{name or 'undecided'}"] = float(sum(layer.schedule == name for layer in layers))
        return out

    def _migration_metrics(self) -> dict[str, float]:
        """Owner migrations finished since the previous log (every rank keeps the same reports)."""
        engine = self._engine()
        if engine is None or not layer_cores(engine):
            return {}
        reports = getattr(engine, "cobalt_migrations", [])
        new, self._reports_seen = reports[self._reports_seen:], len(reports)
        done = [r for r in new if r.ok]
        return {f"{PREFIX}migrations": float(len(done)),
                f"{PREFIX}experts_moved": float(sum(len(r.moved) for r in done)),
                f"{PREFIX}migration_failures": float(len(new) - len(done))}

    def _window(self, model: torch.nn.Module | None) -> torch.Tensor:
        """Counters since the previous call (traffic per layer, then each load_E), summed over ranks."""
        layers = layer_cores(model) if model is not None else []
        if not layers:
            return torch.zeros(0, dtype=torch.float64)
        device = layers[0].stats.load_E.device
        traffic = torch.tensor(
            [[layer.traffic.totals()[key] for key in _TRAFFIC_KEYS] for layer in layers],
            dtype=torch.float64,
            device=device,
        ).reshape(-1)
        loads = torch.cat([layer.stats.load_E.double().reshape(-1) for layer in layers])
        current = torch.cat([traffic, loads])
        previous = self._previous
        self._previous = current.clone()
        if previous is None or previous.shape != current.shape:
            delta = current
        else:
            delta = current - previous
            if bool((delta[traffic.numel() :] < 0).any()):  # NOTE: host sync; stats were reset (replanning)
                delta[traffic.numel() :] = loads
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(delta)
        return delta.cpu()  # NOTE: host sync, once per logging step

    # ----- helpers -------------------------------------------------------------------------------
    def _resolve_config(self) -> CobaltConfig:
        if isinstance(self._explicit, CobaltConfig):
            return self._explicit
        if self._explicit is not None:
            return parse_cobalt_config(self._explicit)
        return split_deepspeed_config(self._ds_config)[1]

    def _engine(self):
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            return None
        wrapped = getattr(trainer, "model_wrapped", None)
        return wrapped if hasattr(wrapped, "zero_optimization_stage") else None  # a DeepSpeedEngine


_CALLBACKS: "weakref.WeakSet[CobaltCallback]" = weakref.WeakSet()  # every live callback (one per Trainer)


def _wrap_trainer_checkpoint_load(callback: "CobaltCallback") -> None:
    """Make the Trainer's resume load (`transformers.trainer.deepspeed_load_checkpoint`, called before
    `on_train_begin`) convert the engine first, so that `CobaltEngine.load_checkpoint` does the load. The patch is
    the process's; it converts the engine of whichever live callback's Trainer owns it (none for a Trainer
    without the callback)."""
    import transformers.trainer as trainer_module

    _CALLBACKS.add(callback)
    current = trainer_module.deepspeed_load_checkpoint
    if getattr(current, "ds_cobalt_original", None) is not None:
        return
    original = current

    def load_checkpoint(deepspeed_engine, checkpoint_path, *args: Any, **kwargs: Any):
        owner = next((live for live in list(_CALLBACKS) if live._engine() is deepspeed_engine), None)
        if owner is not None and getattr(deepspeed_engine, "module", None) is not None:
            owner._adopt(deepspeed_engine, deepspeed_engine.module)
        return original(deepspeed_engine, checkpoint_path, *args, **kwargs)

    load_checkpoint.ds_cobalt_original = original
    trainer_module.deepspeed_load_checkpoint = load_checkpoint


def _wrap_save_model(trainer: Trainer, callback: "CobaltCallback") -> None:
    """Make `trainer.save_model` (also what the Trainer's checkpoints write as `model.safetensors`) write the experts
    in logical order: under ZeRO-1/2 it saves the module's state dict, whose expert slots follow the training layout
    after migrations (`checkpoint.logical_order`; collective: every rank calls `save_model`, as DeepSpeed needs)."""
    original = trainer.save_model
    if getattr(original, "ds_cobalt_original", None) is not None:
        return
    ref = weakref.ref(callback)

    def save_model(*args: Any, **kwargs: Any) -> Any:
        live = ref()
        engine = live._engine() if live is not None else None
        if not isinstance(engine, CobaltEngine):
            return original(*args, **kwargs)
        with logical_order(engine, purpose="save_model"):
            return original(*args, **kwargs)

    save_model.ds_cobalt_original = original
    trainer.save_model = save_model


def _load_deepspeed_config(value: Any) -> dict:
    """`TrainingArguments.deepspeed`: a JSON path, a JSON string or a dict (None: no DeepSpeed)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, (str, Path)) and Path(value).is_file():
        return read_deepspeed_config(value)
    if isinstance(value, str):
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError:
            loaded = None
        if isinstance(loaded, dict):
            return loaded
    raise ValueError(f"TrainingArguments.deepspeed={value!r}: expected a DeepSpeed JSON path or dict")


def _calling_trainer() -> Trainer | None:
    """The Trainer whose `__init__` is running `on_init_end` (found on the call stack), if any."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None
