"""Run examples/train_moe.py on the emulated 2 x 2 cluster at several inter-node rates, both implementations.

    sudo python benchmarks/e2e_cluster.py [--rates 100mbit 1gbit 10gbit] [--steps 30] [--out runs/e2e]

One `benchmarks/cluster/run_cluster.sh` job per (rate, implementation), run one after the other (the
machine has 2 cores); each writes `OUT/<rate>-<impl>/metrics.json` (+ `trace.npz`, `links.json`).
`ds-cobalt calibrate --compare OUT` then compares the measured step-time ratios with the simulator.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    p.add_argument("--impls", nargs="+", default=["deepspeed", "cobalt"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="runs/e2e")
    p.add_argument("--config", default="ds_config_templates/cpu_2nodes_x_2ranks.json")
    p.add_argument("--repo", default=str(REPO),
                   help="source tree to run (e.g. a `git archive HEAD` snapshot); put first on PYTHONPATH")
    p.add_argument("extra", nargs="*", help="more train_moe.py arguments (after --)")
    args = p.parse_args(argv)
    failed = 0
    for rate in args.rates:
        for impl in args.impls:
            out = (Path(args.out) / f"{rate}-{impl}").resolve()
            out.mkdir(parents=True, exist_ok=True)
            cmd = [
                "bash", str(Path(args.repo) / "benchmarks/cluster/run_cluster.sh"), "--rate", rate, "--out", str(out), "--",
                "--deepspeed_config", args.config, "--moe-impl", impl, "--steps", str(args.steps),
                "--metrics-out", str(out / "metrics.json"), "--trace-out", str(out / "trace.npz"), *args.extra,
            ]
            print(f"[e2e] {rate} {impl}", flush=True)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(args.repo).resolve()), os.environ.get("PYTHONPATH", "")])}
            with open(out / "run.log", "w") as log:
                rc = subprocess.run(cmd, cwd=args.repo, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            print(f"[e2e] {rate} {impl} rc={rc}", flush=True)
            failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
