"""DeepSpeed's MoE and ds_cobalt's schedules trained side by side in ONE job, steps interleaved.

    sudo benchmarks/cluster/run_cluster.sh --rate 1gbit --script benchmarks/paired_steps.py -- \
        --deepspeed_config ds_config_templates/cpu_2nodes_x_2ranks.json --steps 40 --json-out OUT/paired.json

Separate jobs (benchmarks/e2e_cluster.py) see the shared machine's noise differently: on the 2-core testbed
DeepSpeed's own tokens/s moved 2x between back-to-back runs. Here every variant is an engine in the same
processes (examples/moe_lm.py's model, same seed and data), and each step runs one optimizer step of every
variant, in an order that rotates each step, with a barrier before each timed step (`--no-barrier`: none, as
`auto`'s trials time their steps; the JSON then also has each step from the last rank's start and the start skew).
A variant's step time is the slowest rank's own window; the script prints median step times, the ratio of
DeepSpeed's median to each variant's (> 1 = faster than DeepSpeed) and the ranks' median CPU time per step, and
writes them to `--json-out` (with `ScheduleGate`'s checks and each layer's schedule decisions).

Variants (`--variants`): deepspeed, hierarchical, direct, dense, auto (ds_cobalt's `transport.schedule`), each
with the config's `"cobalt"` section otherwise (re-planning on by default), and each of those with `-static`
(re-planning off) or `-interval` (`planner.stage2: "interval"`: the re-plan's replicas, no per-step refill); the
first `--skip` steps (the warm-up; `auto`'s trials after a layout change stay in its median) are left out.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from _job import (
    MoELM,
    add_model_arguments,
    batch_for_rank,
    initialize,
    job_parser,
    load_corpus,
    model_config_from,
    moe_class,
    read_config,
    run_interleaved,
    start_job,
)

from ds_cobalt.commands.arg_types import positive_int

SCHEDULES = ("hierarchical", "direct", "dense", "auto")
STATIC = "-static"  # a variant "<schedule>-static": that schedule with re-planning off (planner.replan_interval 0)
INTERVAL = "-interval"  # "<schedule>-interval": that schedule with planner.stage2 "interval"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--variants", nargs="+", default=["deepspeed", "hierarchical", "direct", "dense"],
                   choices=["deepspeed", *SCHEDULES, *(s + suffix for s in SCHEDULES for suffix in (STATIC, INTERVAL))])
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    p.add_argument("--no-barrier", dest="barrier", action="store_false",
                   help="no barrier before a timed step, as `auto`'s trials time them: a variant's step is still the "
                        "slowest rank's own window, and `aligned_medians_s` gives each step from the last rank's start")
    add_model_arguments(p)
    p.add_argument("--json-out", "--metrics-out", dest="json_out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    rank, world = start_job()
    base = read_config(args.deepspeed_config)
    cfg = model_config_from(args, world)
    engines = {}
    for variant in args.variants:
        torch.manual_seed(args.seed)  # same initial weights for every variant
        impl = "deepspeed" if variant == "deepspeed" else "cobalt"
        config = copy.deepcopy(base)
        if impl == "cobalt":
            cobalt = config.setdefault("cobalt", {})
            cobalt["transport"] = {"schedule": variant.removesuffix(STATIC).removesuffix(INTERVAL)}
            if variant.endswith(STATIC):
                cobalt["planner"] = {**cobalt.get("planner", {}), "replan_interval": 0}
            if variant.endswith(INTERVAL):
                cobalt["planner"] = {**cobalt.get("planner", {}), "stage2": "interval"}
        path = Path(f"/tmp/paired_steps_{variant}_rank{rank}.json")
        path.write_text(json.dumps(config))
        engines[variant] = initialize(impl, MoELM(cfg, moe_class(impl)), str(path), config)
    corpus = load_corpus(8 << 20)
    micro = engines[args.variants[0]].train_micro_batch_size_per_gpu()

    batch: list[torch.Tensor] = []

    def next_batch(step: int) -> None:
        batch[:] = batch_for_rank(corpus, seed=args.seed, step=step, rank=rank, world_size=world,
                                  micro_batch=micro, seq_len=args.seq_len)

    def train_step(variant: str, step: int) -> torch.Tensor:
        engine = engines[variant]
        loss, _, _ = engine(*batch, 0.01)
        engine.backward(loss)
        engine.step()
        return loss

    run = run_interleaved(args.variants, args.steps, world, train_step, args.barrier, next_batch)
    times, aligned, skews, cpu, losses = run.times, run.aligned, run.skews, run.cpu, run.losses
    tokens = world * micro * args.seq_len
    medians = run.medians("times", args.skip)
    ref = medians.get("deepspeed")
    aligned_medians = run.medians("aligned", args.skip)
    skew_medians = run.medians("skews", args.skip)
    cpu_medians = run.medians("cpu", args.skip)
    schedules = {v: [core.schedule for core in _cores(engines[v])] for v in args.variants if v != "deepspeed"}
    models = {v: [core.schedule_model for core in _cores(engines[v])] for v in args.variants if v != "deepspeed"}
    means = {v: statistics.fmean(t) for v, t in times.items()}  # every step, trials and warm-up included
    migrations = {v: [(m.step, m.ok, len(m.moved)) for m in getattr(engines[v], "cobalt_migrations", [])]
                  for v in args.variants if v != "deepspeed"}
    gate = {v: [d for hook in getattr(engines[v], "cobalt_step_hooks", []) for d in getattr(hook, "decisions", [])]
            for v in args.variants if v != "deepspeed"}  # `ScheduleGate`'s checks: the model's saving share
    histories = {v: [core.schedule_history for core in _cores(engines[v])] for v in args.variants if v != "deepspeed"}
    result = {"medians_s": medians, "schedule_gate": gate, "schedule_histories": histories,
              "means_all_steps_s": means, "schedule_models": models, "tokens_per_step": tokens,
              "speedup_vs_deepspeed": {v: ref / m for v, m in medians.items()} if ref else {},
              "aligned_medians_s": aligned_medians, "start_skew_medians_s": skew_medians,
              "aligned_step_times_s": aligned, "start_skews_s": skews,
              "cpu_medians_s": cpu_medians, "cpu_times_s": cpu,
              "schedules": schedules, "migrations": migrations, "step_times_s": times, "losses": losses,
              "args": vars(args)}
    if rank == 0:
        print(f"paired steps: {world} ranks, {args.steps} steps ({args.skip} left out), median step (slowest rank)"
              + ("" if args.barrier else ", no barrier before a step"))
        for v, m in medians.items():
            extra = f"  vs DeepSpeed {ref / m:.3f}" if ref else ""
            if not args.barrier:
                extra += (f"  from the last start {aligned_medians[v] * 1e3:.2f} ms"
                          f" (start skew {skew_medians[v] * 1e3:.2f} ms)")
            kept = schedules.get(v, "")  # per layer; None: `auto` still timing that layer
            kept = [("timing" if x is None else x) for x in kept] if isinstance(kept, list) else kept
            print(f"  {v:>14}: {m * 1e3:8.2f} ms  {tokens / m:8.0f} tokens/s{extra}  {kept}"
                  f"  CPU {cpu_medians[v] * 1e3:.1f} ms/rank"
                  f"  (mean of all steps {means[v] * 1e3:.2f} ms)")
        for v, moves in migrations.items():
            if moves:
                print(f"  {v} migrations (after step, committed, experts moved): {moves}")
        for v, per_layer in models.items():
            for i, model in enumerate(per_layer):
                if model:
                    predicted = {c: round(t * 1e3, 2) for c, t in model["predicted_comm_s"].items()}
                    print(f"  {v} layer {i}: model's communication ms {predicted}, ruled out {model['pruned']}")
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _cores(engine):
    from ds_cobalt.integrations.layers import layer_cores

    return layer_cores(engine)


if __name__ == "__main__":
    main()
