"""ds_cobalt's AutoEP layers against plain AutoEP through the HF Trainer, in interleaved pairs of jobs.

    python benchmarks/hf_autoep_pairs.py [--pairs 3] [--steps 150] [--config ds_config_templates/hf_autoep_cpu.json]
        [--out runs/hf_autoep_pairs] [-- extra arguments for examples/hf_trainer_mixtral.py]

Each pair runs `examples/hf_trainer_mixtral.py` under the `deepspeed` launcher (4 ranks, this machine) twice,
`--no-cobalt` first, then with the config's `"cobalt"` section; both print and record every step's wall time.
Prints each job's median step (the first fifth of the steps left out: warm-up and `auto`'s trials) and the ratio
ds_cobalt / plain AutoEP per pair and over the pairs (above 1: ds_cobalt slower). Jobs of one pair follow each other
so they share the machine's state; the pairs show the spread. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from ds_cobalt.commands.arg_types import positive_int

REPO = Path(__file__).resolve().parents[1]


def steady_median_s(step_times_s: list[float]) -> float:
    """Median step seconds without the first fifth of the steps (the example's printed figure)."""
    return float(np.median(step_times_s[len(step_times_s) // 5:]))


def run_job(out: Path, name: str, config: str, steps: int, extra: list[str], port: int) -> float:
    """One launch of the example; its steady median step seconds. RuntimeError naming the log where it fails."""
    launcher = Path(sys.executable).with_name("deepspeed")
    metrics, log = out / f"{name}.json", out / f"{name}.log"
    cmd = [str(launcher) if launcher.exists() else shutil.which("deepspeed") or "deepspeed", "--num_gpus", "4",
           "--master_port", str(port), str(REPO / "examples" / "hf_trainer_mixtral.py"), "--deepspeed", config,
           "--steps", str(steps), "--logging-steps", "10", "--output-dir", str(out / name), "--metrics-out",
           str(metrics), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                            timeout=1200).returncode
    for stale in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*{port}*"):
        stale.unlink(missing_ok=True)
    if rc != 0 or not metrics.is_file():
        raise RuntimeError(f"{name}: exited with {rc}, see {log}")
    return steady_median_s(json.loads(metrics.read_text())["step_times_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=positive_int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--config", default=str(REPO / "ds_config_templates" / "hf_autoep_cpu.json"),
                    help="DeepSpeed JSON with 'expert_parallel' and a 'cobalt' section")
    ap.add_argument("--out", default=str(REPO / "runs" / "hf_autoep_pairs"))
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("extra", nargs="*", help="after --: more arguments for the example (e.g. --model qwen3_moe)")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.steps < 10:
        ap.error(f"--pairs must be >= 1 and --steps >= 10, got {args.pairs} and {args.steps}")
    if "cobalt" not in json.loads(Path(args.config).read_text()):
        ap.error(f"--config {args.config} has no 'cobalt' section")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ratios = []
    print("| pair | plain AutoEP ms/step | ds_cobalt ms/step | ds_cobalt / plain |\n|---|---|---|---|", flush=True)
    for pair in range(1, args.pairs + 1):
        plain = run_job(out, f"plain{pair}", args.config, args.steps, ["--no-cobalt", *args.extra], args.port)
        cobalt = run_job(out, f"cobalt{pair}", args.config, args.steps, args.extra, args.port)
        ratios.append(cobalt / plain)
        print(f"| {pair} | {1e3 * plain:.1f} | {1e3 * cobalt:.1f} | {cobalt / plain:.3f} |", flush=True)
    print(f"median ratio over {len(ratios)} pairs: {float(np.median(ratios)):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    (out / "summary.json").write_text(json.dumps({"config": args.config, "steps": args.steps, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
