"""The `"cobalt"` section of a DeepSpeed JSON config, parsed and validated in one place.

Every component gets one small frozen model; unknown keys and bad values raise `ValueError` naming the
key path (for example `cobalt.topology.ranks_per_node`) and what would be valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SECTION = "cobalt"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class TopologyConfig(_Section):
    """How ranks group into nodes. `ranks_per_node` overrides the launcher's local world size (LOCAL_SIZE,
    LOCAL_WORLD_SIZE, ...).
    `group_timeout_s`: the longest any collective on ds_cobalt's own process groups (rails, nodes, its copy of
    each EP group) waits for a peer before it fails with an error (a lost peer is an error, not a hang), at most a
    week (gloo counts it in milliseconds; 1e10 s timed out at once); DeepSpeed's groups keep
    `deepspeed.init_distributed`'s timeout."""

    ranks_per_node: int | None = Field(default=None, gt=0)
    group_timeout_s: float = Field(default=600.0, gt=0, le=7 * 86400)


class TrafficConfig(_Section):
    """Traffic counters: log a per-layer summary every `log_interval` steps (0 = never)."""

    log_interval: int = Field(default=0, ge=0)


class TraceConfig(_Section):
    """Record the routing of optimizer steps [start_step, start_step + steps) to `path` (DESIGN.md trace format)."""

    path: str | None = Field(default=None, min_length=1)
    steps: int = Field(default=20, gt=0)
    start_step: int = Field(default=0, ge=0)


FIRST_REPLAN_STEP = 12  # default first re-plan: right after `auto`'s trials (10 steps), 12 steps of statistics


class PlannerConfig(_Section):
    """Online stage-1 replanning: after step `first_replan_step` (default min(12, replan_interval): right after
    `auto`'s schedule trials, so the layout improves early, not a full interval in), with `early_replans` also
    after the halvings of the interval that follow it (25 for the default 50: early in training the routing
    drifts and a plan from a few steps of statistics goes stale), and then every
    `replan_interval` optimizer steps (0 = off) plan a layout with
    `policy` from the routing statistics of the last interval (summed over ranks; each rank contributes at
    most `sample_tokens` recent top-k rows per layer); each rank plans its share of the layers (layer i on
    rank i % world size) in a `worker` process at a lower CPU priority (`"thread"`: a thread of the training
    process, which shares its GIL); the decisions are applied `apply_lag` steps later (0 = right away; default
    min(5, replan_interval), so a plan that takes a few steps does not stall training), on every rank, when the
    migration cost model says it pays. At that step a rank waits at most `plan_timeout_s` for its worker;
    past it the worker is stopped, its layers keep their layout, and the next interval plans them again.
    `stage2`: `"step"` refills the spare slots that hold no cross-node traffic copy in every forward of the
    hierarchical schedule from that forward's loads (`runtime/step_spares.py`); `"interval"` keeps the replicas the
    re-plan chose until the next one; `"auto"` (default) times both, and the layout without its replicas
    (`"none"`: each replica costs a weight fetch and a gradient return every step), on the layer's next steps after
    each layout change, once the schedule is chosen, and keeps the fastest, none unless another measures 5 %
    faster (all ranks agree; the direct schedule times the re-plan's replicas against none,
    `LayerCore.replica_modes`).
    `plan_before_trials`: right after step 1, plan the layers whose `auto` cost model expects a schedule that gains
    from the layout (it rules dense out, or prices hierarchical or direct at least 10 % below dense with a saving
    material to the step, `LayerCore.expects_layout_gain`), applied before their schedule trials start (after
    step 3 at the latest), so the trials time, and the first dozen steps run, a planned layout instead of the
    contiguous one (one step of statistics: the planner samples at most `sample_tokens` recent rows per rank
    anyway). With `CobaltEngine`'s gate it runs, and moves owners, only where the model's saving is at least 20 % of
    a step (`schedule_gate.OWNER_MOVE_SHARE`); at later re-plans owners move only where the layer's schedule
    measured at least 15 % faster than dense (`LayerCore.owners_may_move`); another layer takes the plan's spare
    slots only.
    `confirm_on_newer_routing`: the decisions are checked, when applied, on the rows routed since the plan's sample
    (the latest `sample_tokens` per rank, gathered in the same all_reduce as the decisions): a layer keeps its
    layout where a replica change is worse on them, or where a migration no longer pays at its per-token gain less
    two standard errors. Early in training the routing moves within a few steps, and a plan that fitted its
    sample can be worse than the current layout on the steps that follow (docs/planner.md). Off where
    `migration.ignore_cost_model` is on, and with `apply_lag` 0 (no newer rows)."""

    replan_interval: int = Field(default=50, ge=0)
    first_replan_step: int | None = Field(default=None, ge=1)
    policy: str = "cobalt"
    redundant_slots: int = Field(default=1, ge=0)
    apply_lag: int | None = Field(default=None, ge=0)
    sample_tokens: int = Field(default=1024, ge=1)
    seed: int = 0
    worker: Literal["process", "thread"] = "process"
    plan_timeout_s: float = Field(default=300.0, gt=0, le=7 * 86400)
    stage2: Literal["auto", "step", "interval"] = "auto"
    early_replans: bool = True
    plan_before_trials: bool = True
    confirm_on_newer_routing: bool = True

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from .planner.policies import POLICIES

        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; valid: {', '.join(sorted(POLICIES))}")
        return value

    @model_validator(mode="after")
    def _lag_within_interval(self) -> "PlannerConfig":
        if self.replan_interval and self.apply_lag is not None and self.apply_lag > self.replan_interval:
            raise ValueError(f"apply_lag={self.apply_lag} exceeds replan_interval={self.replan_interval}")
        if self.replan_interval and self.first_replan_step is not None:
            if self.first_replan_step > self.replan_interval:
                raise ValueError(f"first_replan_step={self.first_replan_step} exceeds replan_interval="
                                 f"{self.replan_interval}")
            if self.first_replan_step < self.effective_apply_lag:
                raise ValueError(f"first_replan_step={self.first_replan_step} is below apply_lag="
                                 f"{self.effective_apply_lag}")
        return self

    @property
    def effective_first_replan_step(self) -> int:
        """The step after which the first re-plan runs (later ones at multiples of `replan_interval`)."""
        if self.first_replan_step is not None:
            return self.first_replan_step
        return min(FIRST_REPLAN_STEP, self.replan_interval)

    @property
    def early_replan_steps(self) -> tuple[int, ...]:
        """The re-plans before the first multiple of `replan_interval`: `first_replan_step` and, with
        `early_replans`, the halvings of the interval after it (at least `apply_lag` steps after it)."""
        if not self.replan_interval:
            return ()
        first = self.effective_first_replan_step
        steps = {first}
        half = self.replan_interval // 2
        while self.early_replans and half >= first + max(1, self.effective_apply_lag):
            steps.add(half)
            half //= 2
        return tuple(sorted(s for s in steps if s < self.replan_interval))

    @property
    def effective_apply_lag(self) -> int:
        return min(5, self.replan_interval) if self.apply_lag is None else self.apply_lag


class MigrationConfig(_Section):
    """Moving expert owners. A plan that moves owners is applied only when the modelled saving over the next
    interval beats `margin` x the modelled migration time over a link of `inter_node_gbps` gigabit/s (default:
    measured at start-up by a short probe of the process groups, runtime/link_probe.py) (`ignore_cost_model`:
    always, for tests and benchmarks). `checkpoint_logical_order`: save checkpoints in
    DeepSpeed's contiguous expert order (migrate there around the save, and back); `checkpoint_portable_state`:
    also write every parameter's full training state beside it, so `load_checkpoint(..., load_module_only=True)`
    at another world size restores the optimizer state (integrations/portable.py). `asynchronous`: transfers
    start right after the step and run behind the next forward; each layer waits for its own experts in a
    forward pre-hook (false: the whole migration completes inside the step hook)."""

    inter_node_gbps: float | None = Field(default=None, gt=0)
    margin: float = Field(default=1.5, ge=0)
    ignore_cost_model: bool = False
    checkpoint_logical_order: bool = True
    checkpoint_portable_state: bool = True
    asynchronous: bool = True


class OverlapConfig(_Section):
    """Fine-grained compute/communication overlap (runtime/overlap.py): the rail transfer runs behind
    the own-node round, and intra-node rows travel in tiles of at most `tile_rows` rows, each computed
    as it lands. `"auto"`: a cost-model guess refined by timing a few sizes on the first forwards
    (runtime/tile_tuner.py). `rail_chunks`: the inter-node transfer is cut into this many token chunks, so
    the relays compute each chunk while the next one travels and each chunk's results start back as soon as
    they are ready (1: one transfer each way; `"auto"`: 1, 2 or 4, whichever forward is fastest, tried after
    the tile size is settled). `enabled: "auto"`: after that, one forward overlapped and one phased, and the
    faster schedule stays (the overlap costs CPU cycles where compute dominates). With `transport.schedule: "auto"`
    this tuning starts once the layer keeps the hierarchical schedule; during the schedule's trials the overlapped
    candidate runs the guesses (docs/runtime.md)."""

    enabled: bool | Literal["auto"] = False
    tile_rows: int | Literal["auto"] = "auto"
    rail_chunks: int | Literal["auto"] = 2

    @field_validator("tile_rows")
    @classmethod
    def _positive(cls, value):
        if value != "auto" and value <= 0:
            raise ValueError(f"must be a positive integer or 'auto', got {value!r}")
        return value

    @field_validator("rail_chunks")
    @classmethod
    def _chunks(cls, value):
        if value != "auto" and not 1 <= value <= 64:
            raise ValueError(f"must be an integer from 1 to 64 or 'auto', got {value!r}")
        return value


class KernelsConfig(_Section):
    """Kernel backend of the dispatcher's gathers, dedup and weighted sums (ds_cobalt.kernels): `auto` (default:
    torch off CUDA or without CuPy; on CUDA with CuPy each op takes the backend measured faster at its size on an
    H200, `kernels.auto_backend`), `torch` (the reference everywhere), `cupy` (the CUDA kernels for every op; needs
    CuPy and GPU tensors). docs/kernels.md."""

    backend: Literal["torch", "cupy", "auto"] = "auto"


class TransportConfig(_Section):
    """How a layer's tokens travel (runtime/layer.py). `hierarchical`: each token crosses to each remote node
    once, then a relay forwards it inside the node (fewest cross-node bytes, more collective calls and CPU work).
    `direct`: one exchange each way over the EP group, each token once to each destination rank (DeepSpeed's
    call pattern, never more bytes than DeepSpeed). `dense`: DeepSpeed's own padded exchange on the current
    owner layout (DeepSpeed's bytes and calls, no replicas). `auto` (default): whichever trains faster here,
    measured on the layer's first steps (from its forward to the end of the optimizer step) and re-measured after
    each layout change; all ranks agree through one all-reduce. The overlapped schedule is hierarchical: with
    `overlap.enabled` on, `auto`'s hierarchical candidate runs overlapped (the overlap settings are tuned once it is
    kept), and dense stays a candidate. Side by side on the 2 x 2 CPU testbed `auto` kept dense on
    fast links (0.98x DeepSpeed) and hierarchical at 100 Mbit/s (1.48x) (README, docs/runtime.md)."""

    schedule: Literal["auto", "hierarchical", "direct", "dense"] = "auto"


class CobaltConfig(_Section):
    topology: TopologyConfig = TopologyConfig()
    transport: TransportConfig = TransportConfig()
    traffic: TrafficConfig = TrafficConfig()
    trace: TraceConfig = TraceConfig()
    overlap: OverlapConfig = OverlapConfig()
    kernels: KernelsConfig = KernelsConfig()
    planner: PlannerConfig = PlannerConfig()
    migration: MigrationConfig = MigrationConfig()


def parse_cobalt_config(section: Any) -> CobaltConfig:
    """Validate a `"cobalt"` section (a dict, or None for defaults)."""
    if section is None:
        return CobaltConfig()
    if not isinstance(section, dict):
        raise ValueError(f"{SECTION}: expected an object, got {type(section).__name__}")
    try:
        return CobaltConfig.model_validate(section)
    except ValidationError as err:
        raise ValueError(_describe(err)) from None


def read_deepspeed_config(config: str | Path) -> dict:
    """A DeepSpeed config given as a path or a base64 string, read as DeepSpeed reads it (hjson: JSON with comments;
    a duplicate key is an error). ValueError naming the problem."""
    import base64
    import binascii

    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    if Path(config).is_file():
        try:
            return hjson.loads(Path(config).read_text(), object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except (hjson.HjsonDecodeError, ValueError) as err:
            raise ValueError(f"DeepSpeed config {config}: not valid JSON ({err})") from None
    if isinstance(config, str):
        try:
            decoded = base64.urlsafe_b64decode(config).decode("utf-8")
            loaded = hjson.loads(decoded, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except (binascii.Error, UnicodeDecodeError, hjson.HjsonDecodeError, ValueError):
            loaded = None
        if isinstance(loaded, dict):
            return loaded
    raise ValueError(f"DeepSpeed config {str(config)[:200]!r}: expected the path of an existing config file, a dict "
                     "or a base64-encoded config")


def split_deepspeed_config(config: str | Path | dict) -> tuple[dict, CobaltConfig]:
    """Load a DeepSpeed config (path, base64 string or dict, as `deepspeed.initialize` takes it); return it without
    the cobalt section, and that section parsed."""
    if isinstance(config, (str, Path)):
        config = read_deepspeed_config(config)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")
    near = [key for key in config if isinstance(key, str) and key != SECTION
            and key.strip().lower().replace("-", "_") in (SECTION, "ds_cobalt")]
    if near:  # DeepSpeed ignores unknown top-level keys: the run would go on with the defaults, silently
        raise ValueError(f"DeepSpeed config key {near[0]!r}: the ds_cobalt section is spelled {SECTION!r}")
    rest = {key: value for key, value in config.items() if key != SECTION}
    return rest, parse_cobalt_config(config.get(SECTION))


def _describe(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        path = ".".join([SECTION, *(str(part) for part in item["loc"])])
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            lines.append(f"{path}: {item['msg']} (got {item.get('input')!r})")
    return "invalid ds_cobalt config: " + "; ".join(lines)
