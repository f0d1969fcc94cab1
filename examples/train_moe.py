"""Train a small byte-level MoE transformer on Python's standard-library source with DeepSpeed.

    deepspeed --num_gpus 4 examples/train_moe.py \
        --deepspeed_config ds_config_templates/cpu_2nodes_x_2ranks.json [--moe-impl cobalt|deepspeed]

``--moe-impl deepspeed`` uses ``deepspeed.moe.layer.MoE`` and ``deepspeed.initialize``; ``--moe-impl cobalt``
uses ``ds_cobalt.MoE`` and ``ds_cobalt.initialize`` (same constructor, same return values). For the same
seed both see the same data and the same initial weights, so their losses match.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_cobalt.commands.arg_types import positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cobalt_report import StepTracker, print_summary, save_plot, summarize  # noqa: E402
from moe_lm import ModelConfig, MoELM, batch_for_rank, load_corpus, set_threads_from_env  # noqa: E402
from traffic import TRAFFIC_KEYS, DeepSpeedTrafficMeter, RoutingRecorder, summed_over_ranks  # noqa: E402

from ds_cobalt.runtime.comm import collective_device  # noqa: E402


def _schedule_shown(schedule: str | None, overlap: dict | None) -> str:
    """A layer's schedule for the report; the hierarchical one with overlap on says how it runs (the tuner's choice,
    `ds_cobalt.schedule_summary`'s `overlap`)."""
    if schedule is None:
        return "undecided"
    if schedule != "hierarchical" or overlap is None:
        return schedule
    mode = {True: "overlapped", False: "phased", None: "overlap being tuned"}[overlap["overlapped"]]
    return f"{schedule} ({mode})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import deepspeed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--moe-impl", choices=["cobalt", "deepspeed"], default="cobalt")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-out", type=str, default=None, help="write per-step losses, tokens/s, traffic")
    p.add_argument("--trace-out", type=str, default=None, help="write the routing trace (.npz) on rank 0")
    p.add_argument("--plot-out", type=str, default="runs/train_moe_report.png",
                   help="where the cobalt run saves its traffic/load plot ('' = no plot)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--moe-every", type=int, default=1, help="1 = every layer is MoE, 2 = every other layer")
    p.add_argument("--num-experts", type=int, default=32, help="fine-grained by default: 32 small experts, top-6")
    p.add_argument("--ep-size", type=int, default=0, help="expert-parallel size (0 = world size)")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--min-capacity", type=int, default=4)
    p.add_argument("--no-drop-tokens", action="store_true", help="dropless routing (capacity = max load)")
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    p.add_argument("--log-every", type=int, default=10, help="log lines when stderr is not a terminal")
    p.add_argument("--profile-out", type=str, default=None,
                   help="cProfile the training loop of rank 0 into this pstats file (where the CPU time goes)")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if args.deepspeed_config is None:
        p.error("--deepspeed_config is required")
    return args


def read_config(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def ranks_per_node(config: dict[str, Any]) -> int:
    """Node size for the traffic report: ``cobalt.topology.ranks_per_node`` or the launcher's LOCAL_SIZE."""
    override = config.get("cobalt", {}).get("topology", {}).get("ranks_per_node")
    if override:
        return int(override)
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))


def moe_class(impl: str) -> type[torch.nn.Module]:
    if impl == "cobalt":
        import ds_cobalt

        return ds_cobalt.MoE
    from deepspeed.moe.layer import MoE

    return MoE


def initialize(impl: str, model: torch.nn.Module, config_path: str, config: dict[str, Any]) -> Any:
    """Build the engine; DeepSpeed itself never sees the ``"cobalt"`` section."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"}
    )
    if impl == "cobalt":
        import ds_cobalt

        engine, *_ = ds_cobalt.initialize(args=None, model=model, model_parameters=groups, config=config_path)
    else:
        import deepspeed

        ds_config = {k: v for k, v in copy.deepcopy(config).items() if k != "cobalt"}
        engine, *_ = deepspeed.initialize(args=None, model=model, model_parameters=groups, config=ds_config)
    return engine


def traffic_summary(
    impl: str, model: torch.nn.Module, meter: DeepSpeedTrafficMeter | None, steps: int
) -> dict:
    if impl == "cobalt":
        import ds_cobalt

        summary = dict(ds_cobalt.traffic_summary(model))
    else:
        assert meter is not None
        summary = meter.summary(steps)
    return {k: int(summary.get(k, 0)) for k in TRAFFIC_KEYS}


def expert_rows_per_rank(impl: str, model: torch.nn.Module, meter: DeepSpeedTrafficMeter | None) -> list[float]:
    """Collective. Expert rows each rank computed (ds_cobalt: served, replicas included; DeepSpeed: routed)."""
    if impl != "cobalt":
        assert meter is not None
        return meter.expert_rows_per_rank()
    import ds_cobalt

    mine = torch.tensor([float(ds_cobalt.traffic_summary(model)["expert_rows"])], dtype=torch.float64,
                        device=collective_device())
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [float(r) for r in rows]


def all_reduce_sum(summary: dict[str, int]) -> dict[str, int]:
    summed = summed_over_ranks(summary, [k for k in TRAFFIC_KEYS if k != "steps"])
    return {k: summed[k] for k in TRAFFIC_KEYS}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads_from_env()

    import deepspeed

    deepspeed.init_distributed(dist_backend=None)  # gloo on the CPU accelerator, nccl on CUDA
    rank, world = dist.get_rank(), dist.get_world_size()
    config = read_config(args.deepspeed_config)

    torch.manual_seed(args.seed)  # same initial weights on every rank and for both implementations
    cfg = ModelConfig(
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_layers=args.n_layers,
        d_ff=args.d_ff,
        seq_len=args.seq_len,
        moe_every=args.moe_every,
        num_experts=args.num_experts,
        ep_size=args.ep_size or world,
        k=args.top_k,
        capacity_factor=args.capacity_factor,
        min_capacity=args.min_capacity,
        drop_tokens=not args.no_drop_tokens,
    )
    model = MoELM(cfg, moe_class(args.moe_impl))
    engine = initialize(args.moe_impl, model, args.deepspeed_config, config)
    meter = DeepSpeedTrafficMeter(model, ranks_per_node(config)) if args.moe_impl == "deepspeed" else None
    recorder = RoutingRecorder(model) if args.trace_out else None
    tracker = StepTracker(model) if args.moe_impl == "cobalt" else None

    corpus = load_corpus(args.corpus_bytes)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = world * micro * gas * args.seq_len
    dtype = next(p for p in engine.module.parameters()).dtype
    torch.manual_seed(args.seed + 1)  # same gate noise / RTS draws on every run with this seed

    losses: list[float] = []
    step_times: list[float] = []
    cpu_times: list[float] = []
    tty = sys.stderr.isatty()
    bar = None
    if rank == 0 and tty:
        from tqdm import tqdm

        # a pseudo-terminal may report a 0 x 0 size, which makes tqdm print nothing
        cols, rows = shutil.get_terminal_size((100, 20))
        bar = tqdm(total=args.steps, desc=f"train ({args.moe_impl})", unit="step", ncols=cols, nrows=rows)
    profiler = None
    if args.profile_out and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0, cpu0 = time.perf_counter(), time.process_time()
        step_loss = torch.zeros((), dtype=torch.float64, device=collective_device())
        for micro_step in range(gas):
            ids, targets = batch_for_rank(
                corpus,
                seed=args.seed,
                step=step * gas + micro_step,
                rank=rank,
                world_size=world,
                micro_batch=micro,
                seq_len=args.seq_len,
            )
            loss, lm_loss, _ = engine(ids.to(engine.device), targets.to(engine.device), args.aux_loss_coef)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().to(step_loss.device, torch.float64) / gas
        dist.all_reduce(step_loss)  # mean over ranks
        losses.append(step_loss.item() / world)  # NOTE: host sync
        step_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - cpu0)
        if tracker is not None:
            tracker.after_step()
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_step / step_times[-1]:.0f}")
            bar.update()
        elif rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(
                f"[train_moe] step {step + 1}/{args.steps} loss {losses[-1]:.4f} "
                f"tokens/s {tokens_per_step / step_times[-1]:.0f}",
                flush=True,
            )
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile_out)
    # first step includes lazy init (optimizer state, comm buffers): leave it out of the rate when possible
    timed = step_times[1:] or step_times
    tokens_per_s = tokens_per_step * len(timed) / sum(timed)

    local = traffic_summary(args.moe_impl, model, meter, args.steps)
    total = all_reduce_sum(local)
    rows = expert_rows_per_rank(args.moe_impl, model, meter)
    load_max_over_mean = max(rows) / (sum(rows) / len(rows)) if rows and sum(rows) else None
    migrations = len(getattr(engine, "cobalt_migrations", []))
    decisions = schedule_decisions(args.moe_impl, model)
    schedules = [row["schedule"] for row in decisions]
    if recorder is not None:
        recorder.save(args.trace_out)
    if hasattr(engine, "save_cobalt_trace"):  # `cobalt.trace` still recording: write the steps so far
        engine.save_cobalt_trace()
    per_step = tracker.gather() if tracker is not None else None
    cobalt_did = summarize(per_step, engine) if per_step is not None else None

    if rank == 0:
        padded = total["deepspeed_inter_node_bytes_padded"]
        dropless = total["deepspeed_inter_node_bytes_dropless"]
        sent = total["inter_node_bytes"]
        print(
            f"\n=== train_moe report ({args.moe_impl}, {world} ranks, {args.steps} steps, {wall:.1f} s) ==="
        )
        print(f"final loss            {losses[-1]:.4f} (first {losses[0]:.4f})")
        print(f"tokens/s              {tokens_per_s:.0f} ({tokens_per_step} tokens/step)")
        print(f"cross-node bytes      {fmt_bytes(sent)} "
              "(summed over ranks, forward dispatch + combine, replica weights)")
        print(f"DeepSpeed all-to-all  {fmt_bytes(padded)} padded E x C, {fmt_bytes(dropless)} dropless")
        if load_max_over_mean is not None:
            print(f"expert load max/mean  {load_max_over_mean:.3f} over {len(rows)} ranks"
                  f"{'' if args.moe_impl == 'cobalt' else ' (routing demand)'}; migrations {migrations}")
        if schedules:
            # `auto`'s gate: dense kept without trials where the cost model's saving is immaterial to the step
            untimed = [row["history"][0].get("untimed_saving_share") for row in decisions if row.get("history")]
            why = (f"; kept without trials: the cost model's saving over dense is {100 * max(untimed):.1f} % of a "
                   "step" if untimed and None not in untimed else "")
            shown = [_schedule_shown(s, row.get("overlap")) for s, row in zip(schedules, decisions)]
            print(f"transport schedule    {', '.join(shown)} (per MoE layer{why})")
        if padded:
            print(
                f"ratio vs DeepSpeed    {sent / padded:.3f} of padded, {sent / max(dropless, 1):.3f} of dropless"
            )
        if cobalt_did is not None:
            plot = args.plot_out or None
            if plot:
                save_plot(per_step, cobalt_did, plot)
            print_summary(cobalt_did, fmt_bytes, plot)
        if args.metrics_out:
            metrics = {
                "moe_impl": args.moe_impl,
                "world_size": world,
                "ranks_per_node": ranks_per_node(config),
                "steps": args.steps,
                "seed": args.seed,
                "tokens_per_step": tokens_per_step,
                "losses": losses,
                "final_loss": losses[-1],
                "tokens_per_s": tokens_per_s,
                "wall_s": wall,
                "step_times_s": step_times,
                # this process's CPU seconds per step (rank 0, all its threads, no child process such as a planner
                # worker): with several ranks per core, a rank's extra CPU work is every rank's wait
                "cpu_times_s": cpu_times,
                "traffic": total,
                "traffic_rank0": local,
                "expert_rows_per_rank": rows,
                "expert_load_max_over_mean": load_max_over_mean,
                "migrations": migrations,
                "transport_schedules": schedules,
                "schedule_decisions": decisions,
                "cobalt_did": cobalt_did,
                "per_step": per_step,
                "layouts": tracker.layouts if tracker is not None else None,
                "model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                "dtype": str(dtype),
            }
            Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.metrics_out, "w") as f:
                json.dump(metrics, f, indent=1)
        if not all(math.isfinite(x) for x in losses):
            raise SystemExit("non-finite loss")
    dist.barrier()
    # without this gloo aborts at interpreter exit ("terminate called without an active exception")
    dist.destroy_process_group()


def schedule_decisions(impl: str, model) -> list[dict]:
    """Per ds_cobalt layer: the schedule in use (`transport.schedule`; None while `auto` is still timing), the
    timings and the cost model's input of the last `auto` decision, and every decision so far
    (`ds_cobalt.schedule_summary`)."""
    if impl != "cobalt":
        return []
    import ds_cobalt

    return ds_cobalt.schedule_summary(model)


if __name__ == "__main__":
    main()
