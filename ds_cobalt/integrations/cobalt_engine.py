"""`CobaltEngine`: DeepSpeed's engine with ds_cobalt's step and checkpoint behaviour as methods.

DeepSpeed builds the engine (`deepspeed.initialize`, also inside the HF Trainer and with AutoEP); `adopt`
then makes that object a `CobaltEngine` in place (a class change, as AutoEP layers are adopted: same object,
same state), so `isinstance(engine, DeepSpeedEngine)` still holds. A subclass of DeepSpeed's engine (e.g.
`PipelineEngine`) gets a matching subclass. What it adds:
- `step`: commits any pending asynchronous migration first; after an optimizer step (at gradient-accumulation
  boundaries) runs the configured step hooks: traffic logging, traces, `auto`'s gate before its schedule trials
  (`schedule_gate.py`), the replanner, DeepSpeed's monitor
  (TensorBoard / CSV / W&B: schedule decisions, traffic counters every `traffic.log_interval` steps);
- `save_checkpoint` / `load_checkpoint`: logical expert order and portable state (`checkpoint.py`), as
  configured under `cobalt.migration`; a pending migration is committed before a save or a load.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger

from ..config import CobaltConfig
from ..runtime.layer import LayerCore
from . import checkpoint
from .layers import SCHEDULES, layer_cores, traffic_summary
from .migration import flush_pending
from .replan import Replanner
from .replan_state import latest_tag_directory, load_replan_state, save_replan_state, tag_directory, write_latest
from .schedule_gate import ScheduleGate
from .trace import TraceRecorder

StepHook = Callable[["CobaltEngine"], None]

__all__ = ["CobaltEngine", "StepHook"]


class CobaltEngine(DeepSpeedEngine):
    """Not constructed directly: `CobaltEngine.adopt(engine, config)` converts the engine DeepSpeed built."""

    commits_pending_migrations = True  # migrate(asynchronous=True) relies on step/save committing first
    cobalt_config: CobaltConfig | None
    cobalt_step_hooks: list[StepHook]
    _cobalt_cores: list[LayerCore] | None

    @classmethod
    def adopt(cls, engine: DeepSpeedEngine, config: CobaltConfig | None) -> "CobaltEngine":
        """Make `engine` a `CobaltEngine` in place (idempotent; the config of the last call wins) and return
        it. `config=None` adds only the commit of pending migrations (no hooks, DeepSpeed's checkpoints)."""
        if not isinstance(engine, DeepSpeedEngine):
            raise TypeError(f"CobaltEngine.adopt needs a DeepSpeedEngine, got {type(engine).__name__}")
        if not isinstance(engine, CobaltEngine):
            engine.__class__ = _cobalt_class(type(engine))
        assert isinstance(engine, CobaltEngine)
        engine.cobalt_config = config
        if not hasattr(engine, "cobalt_migrations"):
            engine.cobalt_migrations = []  # every migration's report, in order (`migrate`)
        engine._cobalt_cores = None  # the layers' cores, found at the first step (a module walk: ~1 ms a step)
        engine._close_hooks()
        engine.cobalt_step_hooks = engine._configured_hooks(config) if config is not None else []
        return engine

    def _close_hooks(self) -> None:
        """Stop what the hooks run beside training (the replanner's worker process)."""
        for hook in getattr(self, "cobalt_step_hooks", []):
            close = getattr(hook, "close", None)
            if close is not None:
                close()

    def destroy(self) -> None:
        """DeepSpeed's `destroy`, after `save_cobalt_trace` (collective where `cobalt.trace` is still recording)
        and stopping the replanner's worker."""
        self.save_cobalt_trace()
        self._close_hooks()
        super().destroy()

    def save_cobalt_trace(self) -> None:
        """Collective: where `cobalt.trace`'s window is still open (the run ends inside it), write the steps it
        recorded so far, and say so; nothing where it was written already or no trace is configured."""
        for hook in getattr(self, "cobalt_step_hooks", []):
            if isinstance(hook, TraceRecorder):
                hook.finish(self)

    # ----- step --------------------------------------------------------------------------------------
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        self.cobalt_accumulating = True  # gradients wait for the optimizer step (`migrate` refuses to run now)
        return super().backward(*args, **kwargs)

    def _backward_prologue(self, *args: Any, **kwargs: Any) -> Any:
        # DeepSpeed's hook on the forward's outputs: also a plain `loss.backward()` (torch-style, ZeRO-1/2/3)
        self.cobalt_accumulating = True
        return super()._backward_prologue(*args, **kwargs)

    def _take_model_step(self, *args: Any, **kwargs: Any) -> Any:
        # the optimizer step (or its skip after an overflow): no gradient is waiting any more. Every loop reaches it
        # at its boundary: DeepSpeed's (`step` after every micro-batch), the HF Trainer's (accelerate sets the
        # boundary, `step` once per optimizer step), unmanaged accumulation, a pipeline's `train_batch`
        out = super()._take_model_step(*args, **kwargs)
        self.cobalt_accumulating = False
        return out

    def step(self, *args: Any, **kwargs: Any) -> Any:
        flush_pending(self)
        # with managed_gradient_accumulation=false every `step` is the caller's boundary (DeepSpeed's own flag for
        # it is set only inside `step`)
        boundary = self.is_gradient_accumulation_boundary() or not self.managed_gradient_accumulation()
        out = super().step(*args, **kwargs)
        if boundary:
            if self._cobalt_cores is None:
                self._cobalt_cores = layer_cores(self)
            for core in self._cobalt_cores:
                core.step_end()
            for hook in self.cobalt_step_hooks:
                hook(self)
        return out

    def _configured_hooks(self, cobalt: CobaltConfig) -> list[StepHook]:
        """The work ds_cobalt does after each optimizer step, as configured."""
        hooks: list[StepHook] = []
        if cobalt.traffic.log_interval:
            hooks.append(functools.partial(_log_traffic, interval=cobalt.traffic.log_interval))
        if cobalt.trace.path:
            hooks.append(TraceRecorder(self, cobalt.trace.path, cobalt.trace.start_step, cobalt.trace.steps))
        if cobalt.transport.schedule == "auto":  # before the replanner: its plans follow the first choices
            hooks.append(ScheduleGate())
        if cobalt.planner.replan_interval:
            hooks.append(Replanner(self, cobalt))
        if getattr(getattr(self, "monitor", None), "enabled", False):
            hooks.append(MonitorHook(cobalt.traffic.log_interval))
        return hooks

    # ----- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, **kwargs: Any) -> Any:
        """DeepSpeed's `save_checkpoint` (same signature: callers such as the HF Trainer inspect it), then
        ds_cobalt's files beside it; DeepSpeed's `latest` file is written last, once every rank has written all of
        its files, so an interrupted save (a killed rank, a full disk) leaves `latest` on the checkpoint before it
        (DeepSpeed writes it at the end of its own part)."""
        flush_pending(self)
        save = super().save_checkpoint
        # (a decoupled checkpoint engine commits after this returns, and writes `latest` then itself)
        own_latest = bool(save_latest) and not self.checkpoint_engine.is_decoupled()
        args = (save_latest and not own_latest, exclude_frozen_parameters)
        migration = self.cobalt_config.migration if self.cobalt_config is not None else None
        if migration is None or not migration.checkpoint_logical_order:
            result = save(save_dir, tag, {} if client_state is None else client_state, *args, **kwargs)
        else:
            result = checkpoint.save_checkpoint(self, save, migration.checkpoint_portable_state, save_dir, tag,
                                                client_state, *args, **kwargs)
        save_replan_state(self, tag_directory(save_dir, tag, self.global_steps))
        if own_latest:
            write_latest(self, save_dir, tag)
        return result

    def save_16bit_model(self, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's `save_16bit_model` with the experts in logical (DeepSpeed's contiguous) order, so each is
        written under its own name after migrations (collective: every rank calls it, as under ZeRO-3). Like
        DeepSpeed's, it writes rank 0's module: with expert parallelism only rank 0's experts."""
        with checkpoint.logical_order(self, purpose="save_16bit_model"):  # commits a pending migration first
            return super().save_16bit_model(*args, **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, *args: Any, cobalt_portable_state: bool | None = None,
                        **kwargs: Any) -> Any:
        """DeepSpeed's `load_checkpoint`; `cobalt_portable_state` (with `load_module_only=True`): restore ds_cobalt's
        portable state (optimizer state, step counts) always (True), never (False), or where DeepSpeed's own full
        load could not (None: another world size or expert-parallel size; `checkpoint.load_checkpoint`)."""
        # a migration still in flight would otherwise commit its transfers (read before the load) over the loaded
        # weights at the next forward; committed first, the load then replaces everything it moved
        flush_pending(self)
        load = super().load_checkpoint
        migration = self.cobalt_config.migration if self.cobalt_config is not None else None
        if migration is None or not migration.checkpoint_logical_order:
            result = load(load_dir, tag, *args, **kwargs)
        else:
            result = checkpoint.load_checkpoint(self, load, migration.checkpoint_portable_state, load_dir, tag,
                                                *args, restore_portable=cobalt_portable_state, **kwargs)
        directory = latest_tag_directory(load_dir, tag)
        if result[0] is not None and directory is not None and not kwargs.get("load_module_only"):
            load_replan_state(self, directory)
        return result


@functools.cache
def _cobalt_class(base: type) -> type:
    """`CobaltEngine` for DeepSpeed's engine, a `CobaltEngine` subclass of any other engine class."""
    if base is DeepSpeedEngine:
        return CobaltEngine
    return type(f"Cobalt{base.__name__}", (CobaltEngine, base), {"__module__": __name__})


def _log_traffic(engine: CobaltEngine, interval: int) -> None:
    if engine.global_steps % interval or engine.global_rank != 0:
        return
    totals = traffic_summary(engine)
    # AutoEP layers pad nothing: compare with the dropless all-to-all there.
    kind = "padded" if totals["deepspeed_inter_node_bytes_padded"] else "dropless"
    baseline = totals[f"deepspeed_inter_node_bytes_{kind}"]
    ratio = f"{totals['inter_node_bytes'] / baseline:.3f}x" if baseline else "no bytes in"  # one node: none cross
    logger.info(f"ds_cobalt step {engine.global_steps}: inter-node {totals['inter_node_bytes']} B "
                f"({ratio} DeepSpeed's {kind} all-to-all), intra-node {totals['intra_node_bytes']} B")


class MonitorHook:
    """Writes to DeepSpeed's monitor (rank 0): each layer's transport schedule when it is decided
    (`ds_cobalt/schedule/layer<i>`: index in `SCHEDULES`, and the candidates' median step seconds), and the
    traffic counters every `interval` steps (`ds_cobalt/traffic/<counter>`, cumulative, this rank)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.seen: dict[int, str | None] = {}

    def __call__(self, engine: CobaltEngine) -> None:
        if engine.global_rank != 0:
            return
        step = engine.global_steps
        events = []
        for i, core in enumerate(layer_cores(engine)):
            if core.schedule is not None and self.seen.get(i) != core.schedule:
                events.append((f"ds_cobalt/schedule/layer{i}", float(SCHEDULES.index(core.schedule)), step))
                events += [(f"ds_cobalt/schedule/layer{i}/{name}_s", float(t), step)
                           for name, t in core.schedule_timings.items()]
                events += [(f"ds_cobalt/schedule/layer{i}/{name}_model_comm_s", float(t), step)
                           for name, t in core.schedule_model.get("predicted_comm_s", {}).items()]
            self.seen[i] = core.schedule
        if self.interval and step % self.interval == 0:
            events += [(f"ds_cobalt/traffic/{key}", float(value), step)
                       for key, value in traffic_summary(engine).items()]
        if events:
            engine.monitor.write_events(events)
