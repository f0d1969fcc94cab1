"""End-to-end comparison on the emulated 2 x 2 cluster: DeepSpeed's MoE vs ds_cobalt, back to back.

    sudo python benchmarks/e2e_cluster.py [--rates loopback 10gbit 1gbit 100mbit] [--models default fine-grained]
                                          [--steps 60] [--repeats 1] [--out runs/e2e]

Models (examples/train_moe.py arguments):
  default        8 experts, top-2, d_ff 128 (the example's defaults before it became fine-grained)
  fine-grained   32 small experts, top-6, d_ff 32: DeepSeek-like (many experts per token, small GEMMs)

Variants (same data, seed and initial weights; examples/train_moe.py):
  a  deepspeed          DeepSpeed's own MoE layer and all-to-all
  b  cobalt             ds_cobalt's defaults (the template's section only): `transport.schedule` "auto" (the
                        cost model prunes, the first steps time the rest, DeepSpeed's dense exchange kept unless
                        another measures 5% faster), re-planning every 50 steps, one spare slot per rank
  (opt-in) cobalt-direct, cobalt-dense, cobalt-auto   (b) with `transport.schedule` "direct" (each token once
                        per destination rank), "dense" (DeepSpeed's padded exchange) or "auto" (= b)
  (opt-in) cobalt-static   (b) with re-planning off (`planner.replan_interval` 0: no planner workers)
  c  cobalt-placement   ds_cobalt + online placement and replicas (`cobalt.planner`, migrations with
                        optimizer state)
  d  cobalt-placement-overlap   (c) + fine-grained overlap (`cobalt.overlap`)
  (opt-in) cobalt-placement-overlap-pinned   (d) with `transport.schedule: "hierarchical"` (always overlapped)
  (opt-in) cobalt-placement-overlap-auto   (c) + `overlap.enabled: "auto"`: tuned tiles and rail chunks,
                        then overlapped or phased, whichever forward is faster
One `benchmarks/cluster/run_cluster.sh` job per (model, rate, variant), one after the other (2 cores). Each writes
`OUT/<rate>-<variant>/metrics.json` (+ `trace.npz`, `links.json`, `ds_config.json`, the example's
`train_moe_report.png`; the default model, other models under `OUT/<model>/`). Prints, per rate, tokens/s and its
ratio to (a) (steps after the first; also over the second half of the steps alone: the steady state after `auto`'s
trials and the first plans, which a long job amortizes), cross-node bytes per step, expert-row load max/mean over
ranks, the largest loss difference to (a) and each job's host steal time (`host.json`: the share of CPU time a shared
VM's host gave to others while the job ran, which the spread between jobs follows); writes `OUT/summary.json`,
`OUT/summary.md` and the plots of `ds-cobalt report OUT` (`OUT/report/index.html`: throughput and bytes per step,
co-activation heatmaps).
`ds-cobalt calibrate --compare OUT` compares the measured step-time ratios with the simulator.
`--repeats N` runs every variant N times per rate, back to back and in alternating order (repeats after the first
under `OUT/repeats/<k>/`); the ratio to DeepSpeed is then the median of the N ratios of runs made side by side,
which a shared, noisy machine needs (single runs of the same job vary by 20% or more there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from ds_cobalt.commands.arg_types import positive_int

REPO = Path(__file__).resolve().parent.parent

VARIANTS = {
    "deepspeed": {"impl": "deepspeed", "cobalt": {}},
    "cobalt": {"impl": "cobalt", "cobalt": {}},  # the defaults (transport.schedule "auto", re-planning on)
    "cobalt-direct": {"impl": "cobalt", "cobalt": {"transport": {"schedule": "direct"}}},
    "cobalt-dense": {"impl": "cobalt", "cobalt": {"transport": {"schedule": "dense"}}},
    "cobalt-auto": {"impl": "cobalt", "cobalt": {"transport": {"schedule": "auto"}}},
    "cobalt-static": {"impl": "cobalt", "cobalt": {"planner": {"replan_interval": 0}}},  # (b), re-planning off
    "cobalt-no-spare": {"impl": "cobalt", "cobalt": {"planner": {"redundant_slots": 0}}},  # defaults, no spare slot
    "cobalt-placement": {"impl": "cobalt", "cobalt": {
        "planner": {"replan_interval": 10, "redundant_slots": 1, "policy": "cobalt", "apply_lag": 5},
    }},
    "cobalt-placement-overlap": {"impl": "cobalt", "cobalt": {
        "planner": {"replan_interval": 10, "redundant_slots": 1, "policy": "cobalt", "apply_lag": 5},
        "overlap": {"enabled": True},
    }},
    "cobalt-placement-overlap-auto": {"impl": "cobalt", "cobalt": {  # not run by default
        "planner": {"replan_interval": 10, "redundant_slots": 1, "policy": "cobalt", "apply_lag": 5},
        "overlap": {"enabled": "auto", "rail_chunks": "auto"},
    }},
    "cobalt-placement-overlap-pinned": {"impl": "cobalt", "cobalt": {  # (d) with hierarchical pinned: no dense
        "planner": {"replan_interval": 10, "redundant_slots": 1, "policy": "cobalt", "apply_lag": 5},
        "overlap": {"enabled": True}, "transport": {"schedule": "hierarchical"},
    }},
}


MODELS = {
    "default": ["--num-experts", "8", "--top-k", "2", "--d-ff", "128"],
    "fine-grained": ["--num-experts", "32", "--top-k", "6", "--d-ff", "32"],
}


def model_dir(out_root: Path, model: str) -> Path:
    """Where a model's runs go: OUT itself for the default model (the layout `ds-cobalt report` and
    `ds-cobalt calibrate --compare` read), OUT/<model> for the others."""
    return out_root if model == "default" else out_root / model


def rate_gbps(rate: str) -> float:
    """tc rate syntax (100mbit, 1gbit, 10gbit) -> Gbit/s; `loopback` (no limit) counts as 100 Gbit/s."""
    if rate == "loopback":
        return 100.0
    match = re.fullmatch(r"([\d.]+)\s*(k|m|g)?bit", rate.lower())
    if not match:
        raise ValueError(f"--rates: cannot read {rate!r}; use tc syntax like 100mbit or 1gbit")
    scale = {"k": 1e-6, "m": 1e-3, "g": 1.0, None: 1e-9}[match.group(2)]
    return float(match.group(1)) * scale


def variant_config(base: dict, variant: str, rate: str) -> dict:
    config = json.loads(json.dumps(base))
    cobalt = config.setdefault("cobalt", {})
    for key, value in VARIANTS[variant]["cobalt"].items():
        cobalt[key] = {**cobalt.get(key, {}), **value}
    return config


def run_dir(out_model: Path, rate: str, variant: str, repeat: int = 0) -> Path:
    """A run's folder: `<rate>-<variant>/` for the first repeat (what `ds-cobalt report` reads),
    `repeats/<k>/<rate>-<variant>/` for the others (`ds-cobalt calibrate --compare` reads every repeat)."""
    name = f"{rate}-{variant}"
    return out_model / name if repeat == 0 else out_model / "repeats" / str(repeat) / name


def summarize(out: Path, rates: list[str], variants: list[str], repeats: int = 1) -> dict:
    """One row per (rate, variant): the first repeat's figures; `vs DeepSpeed` is the median over repeats of
    the ratio to DeepSpeed's run of the same repeat (runs of one repeat are back to back, so slow drifts of a
    shared machine cancel), with every repeat's ratio listed."""
    rows = []
    for rate in rates:
        base = _metrics(out / f"{rate}-deepspeed")
        for variant in variants:
            m = _metrics(out / f"{rate}-{variant}")
            if m is None:
                rows.append({"rate": rate, "variant": variant, "failed": True})
                continue
            ratios, late, steal = [], [], []
            for k in range(repeats):
                a, b = _metrics(run_dir(out, rate, variant, k)), _metrics(run_dir(out, rate, "deepspeed", k))
                if a is not None and b is not None:
                    ratios.append(a["tokens_per_s"] / b["tokens_per_s"])
                    late.append(_second_half_s(b) / _second_half_s(a))
                host = run_dir(out, rate, variant, k) / "host.json"
                steal.append(json.loads(host.read_text())["steal_fraction"] if host.exists() else None)
            steps = max(1, m["steps"])
            row = {
                "rate": rate, "variant": variant, "tokens_per_s": m["tokens_per_s"],
                "speedup_vs_deepspeed": statistics.median(ratios) if ratios else None,
                "speedup_per_repeat": ratios,
                # the same ratio over the second half of the steps only: the run's steady state, after the start-up
                # (schedule trials, the first plans and migrations), which a long job amortizes
                "second_half_speedup": statistics.median(late) if late else None,
                "host_steal_per_repeat": steal,  # this variant's jobs: CPU time the VM's host gave to others
                # rank 0's median CPU milliseconds per step (first repeat, steps after the first)
                "cpu_ms_per_step": _median_cpu_ms(m),
                "cross_node_bytes_per_step": m["traffic"]["inter_node_bytes"] / steps,
                "expert_load_max_over_mean": m.get("expert_load_max_over_mean"),
                "max_loss_diff_vs_deepspeed": (max(abs(a - b) for a, b in zip(m["losses"], base["losses"]))
                                               if base else None),
                "migrations": m.get("migrations"),
            }
            rows.append(row)
    return {"rows": rows}


def _host_cpu() -> list[int] | None:
    """This machine's CPU time counters (/proc/stat: user nice system idle iowait irq softirq steal ...)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def host_steal(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor gave to others between two `_host_cpu` readings (on a shared VM the
    job-to-job spread follows it: 0.8 % steal ran 26k tokens/s, 8 % the same code 17k)."""
    if before is None or after is None or len(before) < 8:
        return None
    spent = [b - a for a, b in zip(before, after)]
    return spent[7] / max(1, sum(spent))


def _second_half_s(metrics: dict) -> float:
    """Seconds of the second half of a run's steps."""
    steps = metrics["step_times_s"]
    return sum(steps[len(steps) // 2:])


def _median_cpu_ms(metrics: dict) -> float | None:
    """Rank 0's median CPU milliseconds per step after the first (None for metrics written without them)."""
    cpu = metrics.get("cpu_times_s") or []
    return 1e3 * statistics.median(cpu[1:] or cpu) if cpu else None


def _metrics(run: Path) -> dict | None:
    path = run / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def markdown(summary: dict) -> str:
    lines = ["| rate | variant | tokens/s | vs DeepSpeed | per repeat | 2nd half vs DeepSpeed | cross-node MB/step | "
             "load max/mean | max loss diff | CPU ms/step (rank 0) | host steal % per repeat |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        if r.get("failed"):
            lines.append(f"| {r['rate']} | {r['variant']} | failed | | | | | | | | |")
            continue
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        per_repeat = " ".join(f"{x:.2f}" for x in r.get("speedup_per_repeat", []))
        steal = " ".join("-" if x is None else f"{100 * x:.1f}" for x in r.get("host_steal_per_repeat", []))
        lines.append(f"| {r['rate']} | {r['variant']} | {r['tokens_per_s']:.0f} | "
                     f"{fmt(r['speedup_vs_deepspeed'], '.2f')} | {per_repeat} | "
                     f"{fmt(r.get('second_half_speedup'), '.2f')} | "
                     f"{r['cross_node_bytes_per_step'] / 1e6:.2f} | "
                     f"{fmt(r['expert_load_max_over_mean'], '.3f')} | {fmt(r['max_loss_diff_vs_deepspeed'], '.1e')} | "
                     f"{fmt(r.get('cpu_ms_per_step'), '.1f')} | {steal} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["loopback", "10gbit", "1gbit", "100mbit"])
    p.add_argument("--variants", nargs="+", default=["deepspeed", "cobalt", "cobalt-placement",
                                                     "cobalt-placement-overlap"],
                   choices=list(VARIANTS))
    p.add_argument("--models", nargs="+", default=["default", "fine-grained"], choices=list(MODELS))
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of every variant per rate, in alternating order; the ratio is the median over repeats")
    p.add_argument("--out", default="runs/e2e")
    p.add_argument("--config", default="ds_config_templates/cpu_2nodes_x_2ranks.json")
    p.add_argument("--repo", default=str(REPO),
                   help="source tree to run (e.g. a `git archive HEAD` snapshot); put first on PYTHONPATH")
    p.add_argument("extra", nargs="*", help="more train_moe.py arguments (after --)")
    args = p.parse_args(argv)
    for rate in args.rates:
        rate_gbps(rate)  # fail early on a bad rate
    base = json.loads((Path(args.repo) / args.config).read_text())
    out_root = Path(args.out).resolve()
    python_path = os.pathsep.join([str(Path(args.repo).resolve()), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    failed = 0
    tables = []
    for model in args.models:
        out_model = model_dir(out_root, model)
        for rate in args.rates:
            for k in range(args.repeats):
                for variant in (args.variants if k % 2 == 0 else args.variants[::-1]):
                    failed += _run(args, base, env, run_dir(out_model, rate, variant, k), model, rate, variant) != 0
        summary = summarize(out_model, args.rates, args.variants, args.repeats)
        (out_model / "summary.json").write_text(json.dumps(summary, indent=1))
        table = markdown(summary)
        (out_model / "summary.md").write_text(table)
        tables.append(f"model: {model}\n{table}")
        report = subprocess.run([sys.executable, "-m", "ds_cobalt.cli", "report", str(out_model)], cwd=args.repo,
                                env=env)
        failed += report.returncode != 0
    print("\n".join(tables))
    return 1 if failed else 0


def _run(args, base: dict, env: dict, out: Path, model: str, rate: str, variant: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "ds_config.json"
    config.write_text(json.dumps(variant_config(base, variant, rate), indent=2))
    cmd = [
        "bash", str(Path(args.repo) / "benchmarks/cluster/run_cluster.sh"), "--rate", rate, "--out", str(out),
        "--", "--deepspeed_config", str(config), "--moe-impl", VARIANTS[variant]["impl"],
        "--steps", str(args.steps), "--metrics-out", str(out / "metrics.json"),
        "--trace-out", str(out / "trace.npz"), "--plot-out", str(out / "train_moe_report.png"), *MODELS[model],
        *args.extra,
    ]
    print(f"[e2e] {model} {rate} {variant} -> {out}", flush=True)
    before = _host_cpu()
    with open(out / "run.log", "w") as log:
        rc = subprocess.run(cmd, cwd=args.repo, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    (out / "host.json").write_text(json.dumps({"steal_fraction": host_steal(before, _host_cpu())}))
    print(f"[e2e] {model} {rate} {variant} rc={rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
