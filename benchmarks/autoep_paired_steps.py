"""Plain AutoEP and ds_cobalt's AutoEP layers trained side by side in ONE job, steps interleaved.

    deepspeed --num_gpus 4 benchmarks/autoep_paired_steps.py [--deepspeed_config ds_config_templates/hf_autoep_cpu.json]
        [--variants autoep auto] [--steps 60] [--json-out OUT/autoep_paired.json] [model arguments]
    sudo benchmarks/cluster/run_cluster.sh --rate 1gbit --script benchmarks/autoep_paired_steps.py -- --steps 60

The model is `examples/hf_trainer_mixtral.py`'s (the same model arguments: `--model`, `--hidden`, `--layers`,
`--experts`, `--top-k`, `--batch-size`, `--seq-len`) and so are the data (byte windows of the standard library's
source); the HF Trainer is left out so that every variant is an engine in the same processes, stepped as
`benchmarks/paired_steps.py` steps them (rotating order, a barrier before each timed step, the slowest rank's own
window). Separate jobs here spread by +-15 % (`benchmarks/hf_autoep_pairs.py` runs them so).

Variants (`--variants`): `autoep` (DeepSpeed's AutoEP, the config's `"cobalt"` section removed), `auto`, `dense`,
`direct`, `hierarchical` (the config's `"cobalt"` section with that `transport.schedule`; `auto` is the default),
each of the last four with `-static` (re-planning off) or `-nospare` (no spare slots, re-planning on). The config's
`"auto"` values (the Trainer's) are resolved as the Trainer would resolve them for the example: micro-batch
`--batch-size`, no accumulation, clipping 1.0, Adam with `--lr`, betas (0.9, 0.999), eps 1e-8, no weight decay.
Prints each variant's median step (the first `--skip` steps left out) and plain AutoEP's median over it (> 1:
ds_cobalt faster), and each layer's schedule.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from _job import REPO, job_parser, read_config, run_interleaved, start_job
from hf_trainer_mixtral import ByteWindows, add_model_arguments, model_config
from moe_lm import load_corpus
from traffic import summed_over_ranks

from ds_cobalt.commands.arg_types import positive_int

SCHEDULES = ("auto", "dense", "direct", "hierarchical")
STATIC = "-static"
NO_SPARE = "-nospare"  # "<schedule>-nospare": that schedule with planner.redundant_slots 0 (re-planning on)
# what the HF Trainer puts where the example's config says "auto" (its TrainingArguments' defaults)
TRAINER_VALUES = {"gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "betas": [0.9, 0.999], "eps": 1e-8,
                  "weight_decay": 0.0}


def parse_args(argv: list[str] | None = None):
    p = job_parser(__doc__, default_config=str(REPO / "ds_config_templates" / "hf_autoep_cpu.json"))
    p.add_argument("--variants", nargs="+", default=["autoep", "auto"],
                   choices=["autoep", *SCHEDULES, *(s + suffix for s in SCHEDULES for suffix in (STATIC, NO_SPARE))])
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument("--skip", type=int, default=12, help="warm-up steps left out of the medians (auto's trials)")
    add_model_arguments(p)
    p.add_argument("--json-out", "--metrics-out", dest="json_out", default=None)
    return p.parse_args(argv)


def resolve_trainer_values(config: dict, batch_size: int, lr: float) -> dict:
    """`config` with its `"auto"` values set as the HF Trainer sets them for the example; ValueError naming a key
    it has no value for."""
    values = {**TRAINER_VALUES, "train_micro_batch_size_per_gpu": batch_size, "lr": lr}

    def resolve(node, path: str):
        if isinstance(node, dict):
            return {k: resolve(v, f"{path}.{k}" if path else k) for k, v in node.items()}
        if node != "auto":
            return node
        key = path.rsplit(".", 1)[-1]
        if key not in values:
            raise ValueError(f"{path}: 'auto' has no value outside the HF Trainer; set it in the config")
        return values[key]

    return resolve(config, "")


def variant_config(base: dict, variant: str) -> dict | None:
    """The DeepSpeed config of `variant`; None for plain AutoEP's (no `"cobalt"` section)."""
    config = copy.deepcopy(base)
    if variant == "autoep":
        config.pop("cobalt", None)
        return config
    cobalt = config.setdefault("cobalt", {})
    cobalt["transport"] = {**cobalt.get("transport", {}),
                           "schedule": variant.removesuffix(STATIC).removesuffix(NO_SPARE)}
    if variant.endswith(STATIC):
        cobalt["planner"] = {**cobalt.get("planner", {}), "replan_interval": 0}
    if variant.endswith(NO_SPARE):
        cobalt["planner"] = {**cobalt.get("planner", {}), "redundant_slots": 0}
    return config


def traffic_over_ranks(summary: dict[str, int]) -> dict[str, int]:
    """`traffic_summary`'s byte and row counters summed over every rank; steps and layer counts as they are."""
    return summed_over_ranks(summary, [k for k in summary if k != "steps" and not k.startswith("layers_")])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world = start_job()
    import deepspeed
    from transformers import AutoModelForCausalLM

    import ds_cobalt
    from ds_cobalt.integrations.layers import layer_cores

    base = resolve_trainer_values(read_config(args.deepspeed_config), args.batch_size, args.lr)
    engines = {}
    for variant in args.variants:
        torch.manual_seed(args.seed)  # same initial weights for every variant
        model = AutoModelForCausalLM.from_config(model_config(args), dtype=torch.float32)
        init = deepspeed.initialize if variant == "autoep" else ds_cobalt.initialize
        engines[variant], *_ = init(model=model, model_parameters=model.parameters(),
                                    config=variant_config(base, variant))
    data = ByteWindows(load_corpus(1 << 20), args.steps * args.batch_size * world, args.seq_len, args.seed)
    batch: list[torch.Tensor] = []

    def next_batch(step: int) -> None:
        first = (step * world + rank) * args.batch_size
        batch[:] = [data.rows[first : first + args.batch_size]]

    def train_step(variant: str, step: int) -> torch.Tensor:
        engine = engines[variant]
        loss = engine(input_ids=batch[0], labels=batch[0]).loss
        engine.backward(loss)
        engine.step()
        return loss

    run = run_interleaved(args.variants, args.steps, world, train_step, before_round=next_batch)
    medians = run.medians("times", args.skip)
    ref = medians.get("autoep")
    cobalt = [v for v in args.variants if v != "autoep"]
    schedules = {v: [core.schedule for core in layer_cores(engines[v])] for v in cobalt}
    histories = {v: [core.schedule_history for core in layer_cores(engines[v])] for v in cobalt}
    stage2 = {v: [core.replica_history for core in layer_cores(engines[v])] for v in cobalt}
    traffic = {v: traffic_over_ranks(ds_cobalt.traffic_summary(engines[v])) for v in cobalt}
    migrations = {v: [(m.step, m.reason, m.ok, len(m.moved)) for m in getattr(engines[v], "cobalt_migrations", [])]
                  for v in cobalt}
    result = {"medians_s": medians, "autoep_over_variant": {v: ref / m for v, m in medians.items()} if ref else {},
              "cpu_medians_s": run.medians("cpu", args.skip), "schedules": schedules,
              "schedule_histories": histories, "stage2_histories": stage2, "traffic": traffic,
              "migrations": migrations, "step_times_s": run.times, "losses": run.losses, "args": vars(args)}
    if rank == 0:
        print(f"autoep paired steps: {world} ranks, {args.steps} steps ({args.skip} left out), median step "
              "(slowest rank)")
        for v, m in medians.items():
            extra = f"  plain AutoEP / this {ref / m:.3f}" if ref else ""
            print(f"  {v:>20}: {m * 1e3:8.2f} ms{extra}  {schedules.get(v, '')}"
                  f"  (mean of all steps {np.mean(run.times[v]) * 1e3:.2f} ms)")
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps(result, indent=1, default=float))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
