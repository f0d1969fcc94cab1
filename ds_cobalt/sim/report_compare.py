"""Predicted vs measured step times of emulated-cluster runs (`ds-cobalt calibrate --compare RUNS_DIR`).

RUNS_DIR holds `<rate>-<impl>/` folders from `benchmarks/e2e_cluster.py` (`metrics.json` of
examples/train_moe.py, `links.json` of run_cluster.sh, `trace.npz`, or one `RUNS_DIR/trace.npz` for all), and
`repeats/<k>/` with the same for further repeats: each repeat is compared on its own, and each rate's ratios are
the medians over the repeats. Per run, and per layout the run used (the `layouts` its metrics recorded: a
placement run changes layout at each migration; the median step over the stretches is the prediction):

    step = max(t_fixed + moe_cpu(impl), (moe_link_bytes(impl) + other_link_bytes) / bw(rate))   (pipelined)
    step = t_fixed' + other_link_bytes / bw(rate) + moe(impl, rate)                              (serial)

- `moe`: the cluster simulator (`sim/cluster.py`) on the run's recorded trace, hardware = the calibrated
  `emulated-cpu` numbers with the measured goodput of `rate` (variant `deepspeed` or `cobalt`);
- `other_link_bytes`: bytes the node put on its link per step (tbf counter of run_cluster.sh) minus the MoE
  bytes (the run's own traffic counters, forward x 2 for backward): gradient all-reduce, start-up;
- `moe_cpu`: the simulator with an infinitely fast inter-node link; `moe_link_bytes`: its inter-node bytes of the
  busiest node per step. The pipelined form is the prediction: tbf's 512 KiB bucket refills while ranks
  compute and 4 ranks take turns on the link, so transfers overlap the CPU work (measured: the 100mbit steps
  take just the link time); the serial form (the plain simulator) is kept for comparison;
- `t_fixed`: everything else (attention, optimizer, Python), the same constant for every run, fitted on the
  anchor run (by default the DeepSpeed run at the fastest rate);
- `cpu_overhead(impl)`: the CPU time of an implementation that the simulator does not model (ds_cobalt's
  Python and small tensor ops around the exchange), fitted on that implementation's run at the anchor rate.
  Those two are the only fitted numbers: the anchor rate's ratios are fitted, every other rate is predicted
  (`max_abs_rel_error` counts the predicted ones only).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..planner.layout import Layout, contiguous_layout, layout_from_dict
from ..planner.trace import load_trace
from .cluster import predict_step_times
from .hardware import Hardware, ModelShape, parse_rate
from .run_metrics import check_run_metrics

__all__ = ["load_runs", "compare_runs", "format_comparison", "measured_step_s", "sim_variant"]


def measured_step_s(metrics: dict) -> float:
    """Median step time of a run, first step (lazy initialisation) left out."""
    times = metrics["step_times_s"][1:] or metrics["step_times_s"]
    return float(np.median(times))


def load_runs(runs_dir: str | Path, shared_trace: str | Path | None = None) -> dict[str, dict[str, dict]]:
    """`{rate: {impl: {"metrics", "links", "trace_path"}}}` from `<rate>-<impl>/` folders. A run without its own
    `trace.npz` uses `runs_dir/trace.npz`, else `shared_trace`."""
    runs: dict[str, dict[str, dict]] = {}
    shared = Path(runs_dir) / "trace.npz"  # one trace for every run (same seed = same routing)
    if not shared.is_file() and shared_trace is not None:
        shared = Path(shared_trace)
    for d in sorted(Path(runs_dir).iterdir()):
        if not (d / "metrics.json").is_file() or "-" not in d.name:
            continue
        rate, impl = d.name.split("-", 1)  # rates have no "-"; variants may (cobalt-placement-overlap)
        links = json.loads((d / "links.json").read_text()) if (d / "links.json").is_file() else None
        runs.setdefault(rate, {})[impl] = {
            "metrics": _read_metrics(d / "metrics.json"),
            "links": links,
            "trace_path": str(d / "trace.npz") if (d / "trace.npz").is_file()
            else str(shared) if shared.is_file() else None,
        }
    if not runs:
        raise ValueError(f"{runs_dir}: no <rate>-<impl>/metrics.json folders (benchmarks/e2e_cluster.py output)")
    return runs


# what the comparison reads of a run's metrics (examples/train_moe.py --metrics-out)
METRICS_KEYS = ("step_times_s", "model", "tokens_per_step", "world_size", "ranks_per_node", "steps", "traffic")


def _read_metrics(path: Path) -> dict:
    """A run's metrics; ValueError naming the file and what is wrong with it."""
    try:
        metrics = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    return check_run_metrics(metrics, path, METRICS_KEYS)


def _shape(metrics: dict) -> ModelShape:
    m = metrics["model"]
    dtype_bytes = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}.get(metrics.get("dtype"), 4)
    return ModelShape(name="train_moe", num_experts=m["num_experts"], top_k=m["k"], hidden=m["d_model"],
                      ffn=m["d_ff"], ffn_matrices=2, dtype_bytes=dtype_bytes, moe_layers=1,
                      tokens_per_gpu=metrics["tokens_per_step"] // metrics["world_size"])


def sim_variant(impl: str, metrics: dict) -> str:
    """The simulator variant of an e2e run folder's variant: its transport schedule (the one `auto` chose, from
    the run's metrics), overlapped where the variant turns overlap on and the schedule is hierarchical (with
    overlap on, `auto` may keep dense or direct, which run phased)."""
    if impl == "deepspeed":
        return "deepspeed"
    chosen = [s for s in metrics.get("transport_schedules") or [] if s]
    schedule = chosen[0] if chosen else "direct" if impl.endswith("direct") else "dense" if impl.endswith("dense") \
        else "hierarchical"
    if schedule == "hierarchical" and "overlap" in impl:
        return "cobalt-overlap"
    return {"hierarchical": "cobalt", "direct": "cobalt-direct", "dense": "cobalt-dense"}.get(schedule, "cobalt")


def run_layouts(metrics: dict) -> list[tuple[int, Layout]]:
    """`(steps, layout)` per stretch of a run's measured steps (step 0 left out, as in `measured_step_s`): the
    layouts the run recorded (`layouts` in examples/train_moe.py's metrics: each with the first step it served),
    else DeepSpeed's contiguous one (the runtime's start) for every step."""
    m = metrics["model"]
    G = metrics["ranks_per_node"]
    steps = len(metrics["step_times_s"])
    first = 1 if steps > 1 else 0
    recorded = metrics.get("layouts") or []
    if not recorded:
        return [(steps - first, contiguous_layout(m["num_experts"], metrics["world_size"] // G, G))]
    starts = [max(first, int(r["from_step"])) for r in recorded] + [steps]
    starts[0] = first  # the first recorded layout is the one the run started with
    out = []
    for r, a, b in zip(recorded, starts, starts[1:]):
        if b > a:
            out.append((b - a, layout_from_dict(r["layout"], source="metrics layouts")))
    return out


def _run_prediction(run: dict, trace_path: str, hw: Hardware, variant: str) -> list[dict]:
    """Per stretch of one layout (`run_layouts`): its measured steps and the simulator's MoE seconds, MoE seconds
    with an infinitely fast inter-node link (the CPU side: compute, intra-node, per-call costs) and inter-node
    bytes of the busiest node, per step."""
    metrics = run["metrics"]
    m = metrics["model"]
    trace = load_trace(trace_path)
    common = dict(step_tokens=metrics["tokens_per_step"],
                  capacity_factor=m["capacity_factor"] if m.get("drop_tokens", True) else None,
                  min_capacity=m.get("min_capacity", 4))
    out = []
    for steps, layout in run_layouts(metrics):
        pred = predict_step_times(trace, layout, hw, _shape(metrics), variants=("deepspeed", variant), **common)
        cpu = predict_step_times(trace, layout, hw.with_inter_node_rate(1e18), _shape(metrics), variants=(variant,),
                                 **common)
        out.append({"steps": steps, "moe_s": pred["step_s"][variant], "moe_cpu_s": cpu["step_s"][variant],
                    "moe_link_bytes": pred["inter_node_bytes"][variant]})
    return out


def _step_median(values: list[float], steps: list[int]) -> float:
    """The median step of stretches that last `steps` steps at `values` seconds each."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(np.asarray(steps, dtype=np.float64)[order])
    return float(np.asarray(values)[order][np.searchsorted(cumulative, cumulative[-1] / 2.0)])


def _mean_over_steps(stretches: list[dict], key: str) -> float:
    return float(np.average([s[key] for s in stretches], weights=[s["steps"] for s in stretches]))


def _other_bytes(run: dict) -> float:
    """Non-MoE bytes per node per step on the inter-node link (0 without links.json)."""
    metrics, links = run["metrics"], run["links"]
    if not links or not links.get("sent_bytes") or None in links["sent_bytes"]:
        return 0.0
    steps = metrics["steps"]
    nodes = metrics["world_size"] // metrics["ranks_per_node"]
    link = float(np.mean(links["sent_bytes"])) / steps
    moe = 2.0 * metrics["traffic"]["inter_node_bytes"] / nodes / steps  # forward counters, x 2 for backward
    return max(0.0, link - moe)


def repeat_dirs(runs_dir: str | Path) -> list[Path]:
    """The folders of one benchmark run: `runs_dir` (the first repeat) and `runs_dir/repeats/<k>/` (the others,
    from `benchmarks/e2e_cluster.py --repeats`)."""
    extra = Path(runs_dir) / "repeats"
    more = sorted((d for d in extra.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)) \
        if extra.is_dir() else []
    return [Path(runs_dir), *more]


def compare_runs(runs_dir: str | Path, hw: Hardware, anchor: tuple[str, str] | None = None,
                 fit_overheads: bool = True) -> dict:
    """Predicted vs measured step times and DeepSpeed / ds_cobalt ratios per rate (see module docstring), for
    every repeat of the run (`repeat_dirs`): each repeat is fitted and predicted on its own runs (their traces
    and layouts), and a rate's ratios are the medians over repeats, as `benchmarks/e2e_cluster.py` reports them
    (runs of one repeat ran back to back, so slow drifts of a shared machine cancel). `fit_overheads`: fit each
    implementation's unmodelled CPU time on its run at the anchor rate (so that rate's ratios are fitted, the
    others predicted)."""
    shared_trace = Path(runs_dir) / "trace.npz"  # also for the repeats that have none of their own
    results = [_compare_one(d, hw, anchor, fit_overheads, shared_trace) for d in repeat_dirs(runs_dir)
               if any((c / "metrics.json").is_file() for c in d.iterdir())]
    if not results:
        load_runs(runs_dir)  # raises the error that names what is missing
    first = results[0]
    if len(results) == 1:
        return {**first, "repeats": 1}
    ratios = []
    for r in first["ratios"]:
        same = [x for res in results for x in res["ratios"] if (x["rate"], x["impl"]) == (r["rate"], r["impl"])]
        merged = {key: float(np.median([x[key] for x in same])) for key in
                  ("measured_ratio", "predicted_ratio", "serial_predicted_ratio", "moe_only_predicted_ratio")}
        merged["rel_error"] = merged["predicted_ratio"] / merged["measured_ratio"] - 1.0
        ratios.append({"rate": r["rate"], "impl": r["impl"], **merged, "fitted": r["fitted"],
                       "measured_per_repeat": [x["measured_ratio"] for x in same],
                       "predicted_per_repeat": [x["predicted_ratio"] for x in same]})
    return {**first, "ratios": ratios, "repeats": len(results),
            "max_abs_rel_error": max((abs(r["rel_error"]) for r in ratios if not r["fitted"]), default=0.0)}


def _compare_one(runs_dir: Path, hw: Hardware, anchor: tuple[str, str] | None, fit_overheads: bool,
                 shared_trace: Path | None = None) -> dict:
    runs = load_runs(runs_dir, shared_trace)
    if not any("deepspeed" in impls for impls in runs.values()):
        raise ValueError(f"{runs_dir}: no <rate>-deepspeed run, so no ratio to compare (found "
                         f"{', '.join(f'{rate}-{impl}' for rate, impls in runs.items() for impl in impls)})")
    rows = []
    for rate, impls in runs.items():
        trace_path = next((r["trace_path"] for r in impls.values() if r["trace_path"]), None)
        if trace_path is None:
            raise ValueError(f"{runs_dir}/{rate}-*: no trace.npz (run with --trace-out)")
        hw_rate = hw.with_inter_node_rate(rate)
        for impl, run in impls.items():
            stretches = _run_prediction(run, trace_path, hw_rate, sim_variant(impl, run["metrics"]))
            other = _other_bytes(run)
            rows.append({"rate": rate, "impl": impl, "measured_s": measured_step_s(run["metrics"]),
                         "other_bytes": other, "other_s": other / hw_rate.inter_node_bw_node,
                         "bw": hw_rate.inter_node_bw_node, "layouts": len(stretches), "stretches": stretches,
                         **{key: _mean_over_steps(stretches, key) for key in ("moe_s", "moe_cpu_s", "moe_link_bytes")}})
    if anchor is None:
        fastest = max(runs, key=lambda r: hw.link_rates.get(r, parse_rate(r)))
        anchor = (fastest, "deepspeed" if "deepspeed" in runs[fastest] else next(iter(runs[fastest])))
    a = next(r for r in rows if (r["rate"], r["impl"]) == anchor)
    t_fixed = a["measured_s"] - a["other_s"] - a["moe_s"]
    a_link = (a["moe_link_bytes"] + a["other_bytes"]) / a["bw"]
    t_fixed_pipe = a["measured_s"] - a["moe_cpu_s"] if a["measured_s"] > a_link else 0.0
    # Per implementation, the CPU time the simulator does not see (ds_cobalt's Python and small tensor ops
    # around the exchange), fitted on the anchor rate's run of that implementation: 0 for the anchor itself.
    overhead = {r["impl"]: r["measured_s"] - t_fixed_pipe - r["moe_cpu_s"] for r in rows
                if r["rate"] == anchor[0] and r["impl"] != anchor[1]} if fit_overheads else {}
    for r in rows:
        r["cpu_overhead_s"] = overhead.get(r["impl"], 0.0)
        stretches = r.pop("stretches")
        steps = [st["steps"] for st in stretches]
        # Serial model: every transfer on the critical path (the alpha-beta sum of sim/cluster.py).
        r["predicted_serial_s"] = _step_median([t_fixed + r["other_s"] + st["moe_s"] + r["cpu_overhead_s"]
                                                for st in stretches], steps)
        # Pipelined link (tbf bucket, 4 ranks taking turns): the link keeps sending while ranks compute, so
        # a step is the larger of the CPU time and the link time; the run's median step over its layouts.
        link = [(st["moe_link_bytes"] + r["other_bytes"]) / r["bw"] for st in stretches]
        r["link_s"] = _step_median(link, steps)
        r["predicted_s"] = _step_median([max(t_fixed_pipe + st["moe_cpu_s"] + r["cpu_overhead_s"], t)
                                         for st, t in zip(stretches, link)], steps)
    ratios = []
    for rate, impls in runs.items():
        if "deepspeed" not in impls:
            continue
        ds = next(r for r in rows if r["rate"] == rate and r["impl"] == "deepspeed")
        for co in (r for r in rows if r["rate"] == rate and r["impl"] != "deepspeed"):
            meas, pred = ds["measured_s"] / co["measured_s"], ds["predicted_s"] / co["predicted_s"]
            ratios.append({"rate": rate, "impl": co["impl"], "measured_ratio": meas, "predicted_ratio": pred,
                           "serial_predicted_ratio": ds["predicted_serial_s"] / co["predicted_serial_s"],
                           "moe_only_predicted_ratio": ds["moe_s"] / co["moe_s"],
                           "rel_error": pred / meas - 1.0})
    fitted_rate = anchor[0] if fit_overheads else None
    for r in ratios:
        r["fitted"] = r["rate"] == fitted_rate
    return {"t_fixed_s": t_fixed_pipe, "t_fixed_serial_s": t_fixed, "anchor": list(anchor), "runs": rows,
            "cpu_overhead_s": overhead,
            "ratios": ratios,
            "max_abs_rel_error": max((abs(r["rel_error"]) for r in ratios if not r["fitted"]), default=0.0),
            "hardware": hw.to_json_dict()}


def format_comparison(result: dict) -> str:
    fitted = ", ".join(f"{impl} {s * 1e3:+.1f} ms" for impl, s in result.get("cpu_overhead_s", {}).items())
    repeats = result.get("repeats", 1)
    lines = [f"t_fixed = {result['t_fixed_s'] * 1e3:.1f} ms (fitted on {'/'.join(result['anchor'])})"
             + (f"; unmodelled CPU per step, fitted at {result['anchor'][0]}: {fitted}" if fitted else "")
             + (f"; runs of the first of {repeats} repeats below, ratios are medians over the repeats"
                if repeats > 1 else ""),
             f"{'rate':<9}{'impl':<26}{'measured ms':>12}{'predicted ms':>13}{'serial ms':>10}{'moe cpu ms':>11}"
             f"{'link ms':>9}{'layouts':>8}"]
    for r in result["runs"]:
        lines.append(f"{r['rate']:<9}{r['impl']:<26}{r['measured_s'] * 1e3:>12.1f}{r['predicted_s'] * 1e3:>13.1f}"
                     f"{r['predicted_serial_s'] * 1e3:>10.1f}{r['moe_cpu_s'] * 1e3:>11.1f}{r['link_s'] * 1e3:>9.1f}"
                     f"{r.get('layouts', 1):>8}")
    lines.append(f"{'rate':<9}{'impl':<26}{'DS/impl measured':>17}{'predicted':>11}{'error':>8}{'serial pred':>13}"
                 f"{'MoE-only serial':>17}")
    for r in result["ratios"]:
        lines.append(f"{r['rate']:<9}{r['impl']:<26}{r['measured_ratio']:>17.3f}{r['predicted_ratio']:>11.3f}"
                     f"{r['rel_error'] * 100:>7.1f}%{r['serial_predicted_ratio']:>13.3f}"
                     f"{r['moe_only_predicted_ratio']:>17.3f}" + ("  (fitted)" if r.get("fitted") else "")
                     + (f"  per repeat: measured {' '.join(f'{x:.2f}' for x in r['measured_per_repeat'])}, predicted "
                        f"{' '.join(f'{x:.2f}' for x in r['predicted_per_repeat'])}" if "measured_per_repeat" in r
                        else ""))
    if any(not r.get("fitted") for r in result["ratios"]):
        lines.append(f"largest error at the predicted rates: {result['max_abs_rel_error'] * 100:.1f}%")
    else:
        lines.append("nothing predicted: every rate in the folder was used to fit the model (add a loopback run to "
                     "fit on, or pass --hardware-json)")
    return "\n".join(lines)
