"""`ds-cobalt simulate`: score a layout on a routing trace (or replay it with the two-timescale policy)."""

from __future__ import annotations

import argparse
import json

HELP = "simulate cross-node traffic and load balance of a layout on a trace"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="routing trace .npz (required unless --synth-gpus)")
    parser.add_argument("--layout", help="layout .json (required unless --synth-gpus)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--replay", action="store_true",
                        help="replay the trace step by step: stage 1 every --replan-interval steps, stage 2 every step")
    parser.add_argument("--replan-interval", type=int, default=None, help="--replay: steps between re-plans (4)")
    parser.add_argument("--steps", type=int, default=None, help="steps the trace is cut into for --replay (16)")
    parser.add_argument("--decay", type=float, default=None, help="EMA decay of the statistics for --replay (0.7)")
    parser.add_argument("--stage2", choices=("step", "predicted", "interval"), default=None,
                        help="--replay: spare slots refilled from each step's loads (the runtime's default, step), "
                             "from the averaged statistics, or kept from the last re-plan")
    parser.add_argument("--expert-params", type=int, default=None,
                        help="--replay: parameters per expert, for the migration cost model (default: a DeepSeek-like "
                             "expert, 17.3M)")
    parser.add_argument("--inter-node-gbps", type=float, default=None,
                        help="--replay: inter-node link for the migration cost model (default 50)")
    parser.add_argument("--hidden-bytes", type=int, default=None,
                        help="--replay: bytes of one token's hidden state on the wire (default 8192: 4096 x bf16)")
    hw = parser.add_argument_group("step time (cluster simulator, docs/simulator.md)")
    hw.add_argument("--hardware", default=None, help="hardware preset: B200, H100, H200, emulated-cpu")
    hw.add_argument("--hardware-json", default=None, help="custom hardware (ds-cobalt/hardware-v1 JSON)")
    hw.add_argument("--inter-node-rate", default=None, help="override the inter-node bandwidth (e.g. 100mbit)")
    hw.add_argument("--model-shape", default=None, help="mixtral, qwen or deepseek (hidden, ffn, layers, ...)")
    hw.add_argument("--hidden", type=int, default=None, help="hidden size (overrides --model-shape)")
    hw.add_argument("--ffn", type=int, default=None, help="expert intermediate size (overrides --model-shape)")
    hw.add_argument("--ffn-matrices", type=int, default=None, help="3 = SwiGLU, 2 = plain MLP")
    hw.add_argument("--dtype-bytes", type=int, default=None, help="bytes per activation element (2 = bf16)")
    hw.add_argument("--step-tokens", type=int, default=None, help="tokens per step, all ranks (default: whole trace)")
    hw.add_argument("--capacity-factor", type=float, default=None,
                    help="DeepSpeed capacity factor (default 1.25; 0 = pad to the largest expert count, "
                         "drop_tokens=False)")
    hw.add_argument("--min-capacity", type=int, default=None, help="DeepSpeed's min_capacity (default 4)")
    hw.add_argument("--synth-gpus", type=int, default=None,
                    help="no trace: predict a synthetic --model-shape job on this many GPUs")


# step-time model flags (their value must be >= the bound; None: not given)
_STEP_TIME_MINIMA = {"hidden": 1, "ffn": 1, "ffn_matrices": 1, "dtype_bytes": 1, "step_tokens": 1,
                     "capacity_factor": 0, "min_capacity": 0, "synth_gpus": 1, "expert_params": 1,
                     "inter_node_gbps": 1e-6, "hidden_bytes": 1}
_STEP_TIME_FLAGS = ("model_shape", "hidden", "ffn", "ffn_matrices", "dtype_bytes", "step_tokens", "inter_node_rate",
                    "capacity_factor", "min_capacity")
_STEP_TIME_DEFAULTS = {"capacity_factor": 1.25, "min_capacity": 4}
_REPLAY_DEFAULTS = {"replan_interval": 4, "steps": 16, "decay": 0.7, "stage2": "step", "expert_params": None,
                    "inter_node_gbps": None, "hidden_bytes": None}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_flags(args: argparse.Namespace) -> None:
    """ValueError naming a flag with an impossible value, or one that the chosen mode would ignore."""
    for name, low in _STEP_TIME_MINIMA.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"{_flag(name)} must be >= {low}, got {value}")
    step_time = args.hardware or args.hardware_json or args.synth_gpus
    if not step_time:
        given = [_flag(n) for n in _STEP_TIME_FLAGS if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: for the step-time model only (with --hardware, --hardware-json or "
                             "--synth-gpus)")
    if step_time and args.replay:
        raise ValueError("--replay: not with the step-time model (--hardware, --hardware-json, --synth-gpus)")
    if args.synth_gpus:
        given = [_flag(n) for n in ("trace", "layout") if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: not with --synth-gpus (it plans on a synthetic trace)")
    if not args.replay:
        given = [_flag(n) for n in _REPLAY_DEFAULTS if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: for --replay only")
    # the flags left out take their defaults
    for name, default in {**_REPLAY_DEFAULTS, **_STEP_TIME_DEFAULTS}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def run(args: argparse.Namespace) -> int:
    from ..planner.layout import load_layout
    from ..planner.trace import load_trace
    from ..sim.metrics import METRICS, simulate

    _check_flags(args)
    if args.hardware or args.hardware_json or args.synth_gpus:
        return _run_step_time(args)
    if not args.trace or not args.layout:
        raise ValueError("--trace and --layout are required (or --synth-gpus with --model-shape and --hardware)")
    trace = load_trace(args.trace)
    layout = load_layout(args.layout)
    if args.replay:
        from dataclasses import replace

        from tqdm import tqdm

        from ..planner.migration import LinkModel
        from ..sim.replay import replay

        sizes = {"expert_params": args.expert_params, "inter_node_gbps": args.inter_node_gbps,
                 "token_bytes": args.hidden_bytes}
        link = replace(LinkModel(), **{k: v for k, v in sizes.items() if v is not None})
        with tqdm(total=trace.num_layers, desc="replay", unit="layer", disable=args.json) as bar:
            report = replay(trace, layout, steps=args.steps, replan_interval=args.replan_interval,
                            decay=args.decay, link=link, progress=lambda _: bar.update(1), stage2=args.stage2)
    else:
        report = simulate(trace, layout)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    width = max(len(m) for m in METRICS)
    header = "layer".ljust(7) + "".join(m.rjust(width + 2) for m in METRICS)
    print(header)
    for i, row in enumerate(report["layers"]):
        print(str(i).ljust(7) + "".join(f"{row[m]:.4f}".rjust(width + 2) for m in METRICS))
    print("mean".ljust(7) + "".join(f"{report['mean'][m]:.4f}".rjust(width + 2) for m in METRICS))
    if args.replay:
        print(f"replans: {report['replans']}, migrations: {report['migrations']}, stage 2: {report['stage2']}, "
              f"median per-step GPU load max/mean {report['step_gpu_load_max_over_mean_median']:.4f}")
    return 0


def _run_step_time(args: argparse.Namespace) -> int:
    """`--hardware`/`--hardware-json`: predicted MoE step time per variant and speedups vs DeepSpeed."""
    from dataclasses import replace

    from ..planner.layout import load_layout
    from ..planner.trace import load_trace
    from ..sim.cluster import format_prediction, predict_step_times, predict_synthetic
    from ..sim.hardware import ModelShape, get_hardware, get_model_shape, load_hardware_json

    if args.hardware and args.hardware_json:
        raise ValueError("give --hardware or --hardware-json, not both")
    if not (args.hardware or args.hardware_json):
        raise ValueError("--synth-gpus needs --hardware PRESET or --hardware-json FILE")
    hw = load_hardware_json(args.hardware_json) if args.hardware_json else get_hardware(args.hardware)
    if args.inter_node_rate:
        hw = hw.with_inter_node_rate(args.inter_node_rate)
    cf = None if args.capacity_factor == 0 else args.capacity_factor
    overrides = {k: v for k, v in (("hidden", args.hidden), ("ffn", args.ffn), ("ffn_matrices", args.ffn_matrices),
                                   ("dtype_bytes", args.dtype_bytes)) if v is not None}
    if args.synth_gpus:
        if not args.model_shape:
            raise ValueError("--synth-gpus needs --model-shape (mixtral, qwen, deepseek)")
        shape = replace(get_model_shape(args.model_shape), **overrides)
        pred = predict_synthetic(shape, hw, args.synth_gpus, capacity_factor=cf)
        head = (f"{shape.name} on {args.synth_gpus} x {hw.name}: expert-parallel group {pred['ep']} GPUs = "
                f"{pred['nodes']} nodes x {pred['gpus_per_node']}, {shape.moe_layers} MoE layers, "
                f"{shape.tokens_per_gpu} tokens/GPU")
    else:
        if not args.trace or not args.layout:
            raise ValueError("--hardware needs --trace and --layout (or --synth-gpus)")
        trace = load_trace(args.trace)
        layout = load_layout(args.layout)
        if args.model_shape:
            shape = replace(get_model_shape(args.model_shape), num_experts=trace.num_experts, top_k=trace.top_k,
                            moe_layers=1, **overrides)
        else:
            missing = [k for k in ("hidden", "ffn") if k not in overrides]
            if missing:
                raise ValueError(f"--hardware needs --model-shape or {' and '.join('--' + k for k in missing)}")
            shape = ModelShape(num_experts=trace.num_experts, top_k=trace.top_k, **overrides)
        pred = predict_step_times(trace, layout, hw, shape, step_tokens=args.step_tokens, capacity_factor=cf,
                                  min_capacity=args.min_capacity)
        head = (f"{trace.num_layers} MoE layer(s), {pred['steps']} step(s), {layout.nodes} nodes x "
                f"{layout.gpus_per_node} GPUs on {hw.name}")
    if args.json:
        print(json.dumps(pred, indent=1))
        return 0
    print(head)
    print(format_prediction(pred))
    return 0
