"""What a re-plan in flight costs the training steps: worker processes vs threads, one job.

    sudo benchmarks/cluster/run_cluster.sh --rate loopback --script benchmarks/replan_overhead.py -- \
        --deepspeed_config ds_config_templates/cpu_2nodes_x_2ranks.json --json-out OUT/replan_overhead.json

The model is fine-grained (default 64 experts, top-6, 8 MoE layers; examples/moe_lm.py). For each mode of
`cobalt.planner.worker` ("process", "thread") and for "off" (no re-planning, the control), one engine trains
`--steps` steps with `replan_interval = --interval` and `apply_lag = --lag`. The migration margin is set so high
that no plan is applied: the layout, and so the step's own cost, stays the same, and only the planning differs.
Each interval is cut into the steps with a plan in flight (the step whose hook gathers the statistics and hands
them to the planner, through the step whose hook collects the decisions) and the idle rest. A step's time is
the slowest rank's (barrier before it). The script prints, per mode, the mean step time of both windows, their
ratio and the median of the per-interval ratios (1.0 = planning costs the training nothing; target <= 1.05; "off"
shows the noise floor), and the slowest rank's planning time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
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
    read_config,
    start_job,
)

from ds_cobalt.commands.arg_types import positive_int

MODES = ("off", "process", "thread")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=positive_int, default=80, help="steps per mode after the warm-up")
    p.add_argument("--warmup", type=int, default=20, help="steps before the first timed interval")
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--lag", type=int, default=5)
    p.add_argument("--sample-tokens", type=int, default=1024, help="cobalt.planner.sample_tokens")
    add_model_arguments(p, n_layers=8, d_ff=32, num_experts=64, top_k=6)
    p.add_argument("--json-out", "--metrics-out", dest="json_out", default=None)
    return p.parse_args(argv)


def in_flight(step: int, interval: int, lag: int) -> bool:
    """Step `step` (1-based, as engine.global_steps after it) runs with a plan in flight."""
    return step % interval <= lag


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not 0 < args.lag < args.interval - 1 or args.warmup % args.interval or args.steps < 2 * args.interval:
        raise SystemExit("need 0 < --lag < --interval - 1 (idle steps in every interval), --warmup a multiple of "
                         "--interval and --steps >= 2 x --interval (a whole interval with its plan in flight)")

    from ds_cobalt.integrations.replan import Replanner

    rank, world = start_job()
    base = read_config(args.deepspeed_config)
    cfg = model_config_from(args, world)
    corpus = load_corpus(8 << 20)
    result: dict[str, dict] = {}
    for mode in args.modes:
        torch.manual_seed(args.seed)
        config = copy.deepcopy(base)
        cobalt = config.setdefault("cobalt", {})
        # every mode on one schedule without `auto`'s trials: on fast links `auto` keeps dense, whose layers are not
        # re-planned, and this benchmark would time no planning at all
        cobalt["transport"] = {"schedule": "hierarchical"}
        if mode != "off":
            cobalt["planner"] = {"replan_interval": args.interval, "apply_lag": args.lag, "worker": mode,
                                 "sample_tokens": args.sample_tokens, "redundant_slots": 0,
                                 "first_replan_step": args.interval, "early_replans": False,
                                 "plan_before_trials": False}
            cobalt["migration"] = {"margin": 1e12}  # plan, never apply: the step's own cost stays the same
        else:
            cobalt["planner"] = {"replan_interval": 0, "redundant_slots": 0}  # the control: no planning
        path = Path(f"/tmp/replan_overhead_{mode}_rank{rank}.json")
        path.write_text(json.dumps(config))
        engine = initialize("cobalt", MoELM(cfg, __import__("ds_cobalt").MoE), str(path), config)
        micro = engine.train_micro_batch_size_per_gpu()
        flight, idle, plan_s, hook_s = [], [], [], {}
        per_interval: dict[int, tuple[list[float], list[float]]] = {}
        for step in range(args.warmup + args.steps):
            ids, targets = batch_for_rank(corpus, seed=args.seed, step=step, rank=rank, world_size=world,
                                          micro_batch=micro, seq_len=args.seq_len)
            dist.barrier()
            t0 = time.perf_counter()
            loss, _, _ = engine(ids, targets, 0.01)
            engine.backward(loss)
            engine.step()
            seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                gs = int(engine.global_steps)
                busy = in_flight(gs, args.interval, args.lag)
                (flight if busy else idle).append(float(seconds))
                # the interval whose plan is in flight: steps s .. s + lag, then its idle steps up to s + interval - 1
                per_interval.setdefault(gs // args.interval, ([], []))[0 if busy else 1].append(float(seconds))
            if rank == 0 and int(engine.global_steps) % args.interval == 0:
                print(f"[replan_overhead] {mode}: step {int(engine.global_steps)}/{args.warmup + args.steps}, "
                      f"last step {float(seconds) * 1e3:.0f} ms", flush=True)
        for hook in engine.cobalt_step_hooks:
            if isinstance(hook, Replanner):
                plan_s = [h["slowest_share_s"] for h in hook.history]
                hook_s = {k: statistics.fmean(h[k] for h in hook.history) for k in ("gather_s", "submit_s", "collect_s")
                          if hook.history and k in hook.history[0]}
        ratios = [statistics.fmean(b) / statistics.fmean(i) for b, i in per_interval.values() if b and i]
        # median step time by position in the interval: 0 = the step whose hook gathers and submits, lag = apply
        whole = [b for b, _ in per_interval.values() if len(b) == args.lag + 1]
        by_position = [statistics.median(b[j] for b in whole) for j in range(args.lag + 1)] if whole else []
        result[mode] = {"in_flight_mean_s": statistics.fmean(flight), "idle_mean_s": statistics.fmean(idle),
                        "ratio": statistics.fmean(flight) / statistics.fmean(idle), "plan_s": plan_s,
                        "median_interval_ratio": statistics.median(ratios), "interval_ratios": ratios,
                        "rank0_hook_s": hook_s, "in_flight_median_by_position_s": by_position,
                        "in_flight_steps_s": flight, "idle_steps_s": idle}
        engine.destroy()
    if rank == 0:
        print(f"replan overhead: {world} ranks, E={args.num_experts} k={args.top_k} {args.n_layers} MoE layers, "
              f"interval {args.interval}, lag {args.lag}, {args.steps} timed steps per mode (slowest rank)")
        for mode, r in result.items():
            plans = f"  planning (slowest rank's share) {statistics.fmean(r['plan_s']):.2f} s" if r["plan_s"] else ""
            print(f"  {mode:>8}: plan in flight {r['in_flight_mean_s'] * 1e3:8.2f} ms, idle "
                  f"{r['idle_mean_s'] * 1e3:8.2f} ms, ratio {r['ratio']:.3f} (median of {len(r['interval_ratios'])} "
                  f"intervals {r['median_interval_ratio']:.3f}){plans}")
            print(f"            by position in the interval (ms): "
                  f"{[round(t * 1e3) for t in r['in_flight_median_by_position_s']]}, idle median "
                  f"{statistics.median(r['idle_steps_s']) * 1e3:.0f}; rank 0's hook "
                  f"{ {k: round(v * 1e3) for k, v in r['rank0_hook_s'].items()} } ms")
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps({"modes": result, "args": vars(args)}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
