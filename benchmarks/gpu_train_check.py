"""`examples/train_moe.py` on one device, DeepSpeed's MoE against ds_cobalt's, same seed and data: losses, step times.

    python3 benchmarks/gpu_train_check.py --config ds_config_templates/gpu_example.json [--steps 40] [--fp32]

One process, world size 1 (NCCL on CUDA, gloo on CPU): DeepSpeed's real engine and optimizer on the device, so it
checks the training path end to end (parity of the losses step by step; in fp32 they must agree to ~1e-5), not the
network. `--fp32` turns bf16 off in a copy of the config; the optimizer runs torch's Adam (`torch_adam`), so no
DeepSpeed op is built. Writes `$OUT/train_check_<dtype>.json` and prints the largest loss difference and the median
step time of both after the first `--skip` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(impl: str, config: Path, steps: int, out: Path, port: int) -> dict:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    metrics = out.with_suffix(f".{impl}.json")
    cmd = [sys.executable, str(REPO / "examples" / "train_moe.py"), "--deepspeed_config", str(config),
           "--moe-impl", impl, "--steps", str(steps), "--metrics-out", str(metrics), "--plot-out", ""]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(metrics.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "ds_config_templates" / "gpu_example.json"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=15, help="steps left out of the step-time medians (start, trials)")
    p.add_argument("--fp32", action="store_true")
    args = p.parse_args()
    out_dir = Path(os.environ.get("OUT") or "./gpu_results")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(args.config).read_text())
    config.setdefault("optimizer", {}).setdefault("params", {})["torch_adam"] = True
    if args.fp32:
        config["bf16"] = {"enabled": False}
        config.pop("fp16", None)
    dtype = "fp32" if args.fp32 else "bf16" if config.get("bf16", {}).get("enabled") else "config"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds_config.json"
        path.write_text(json.dumps(config))
        runs = {impl: run(impl, path, args.steps, Path(tmp) / "metrics", 29571 + i)
                for i, impl in enumerate(("deepspeed", "cobalt"))}
    ds, cb = runs["deepspeed"], runs["cobalt"]
    diffs = [abs(a - b) for a, b in zip(ds["losses"], cb["losses"])]
    step_ms = {impl: 1e3 * statistics.median(r["step_times_s"][args.skip:]) for impl, r in runs.items()}
    result = {"dtype": dtype, "steps": args.steps, "max_loss_diff": max(diffs), "first_loss_diff_step":
              next((i + 1 for i, d in enumerate(diffs) if d > 1e-5), None), "median_step_ms": step_ms,
              "losses": {impl: r["losses"] for impl, r in runs.items()},
              "schedules": cb.get("transport_schedules"), "schedule_decisions": cb.get("schedule_decisions"),
              "tokens_per_s": {k: r["tokens_per_s"] for k, r in runs.items()}}
    (out_dir / f"train_check_{dtype}.json").write_text(json.dumps(result, indent=1))
    print(f"{dtype}: max loss diff {result['max_loss_diff']:.2e} over {args.steps} steps (first above 1e-5: step "
          f"{result['first_loss_diff_step']}); median step after {args.skip}: DeepSpeed {step_ms['deepspeed']:.2f} ms, "
          f"ds_cobalt {step_ms['cobalt']:.2f} ms ({step_ms['deepspeed'] / step_ms['cobalt']:.2f}x); "
          f"schedules {result['schedules']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
