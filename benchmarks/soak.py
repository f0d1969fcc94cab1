"""A soak run with faults: random owner migrations, injected transfer failures, one SIGKILLed rank, one resume.

    python benchmarks/soak.py [--steps 300] [--kill-at 137] [--out runs/soak] [--rate 100mbit]

Two jobs of benchmarks/soak_job.py under the real `deepspeed` launcher (4 CPU ranks as 2 nodes x 2; with
`--rate`, on the emulated cluster of benchmarks/cluster/run_cluster.sh, root):
- undisturbed: `--steps` steps with a random owner migration every `--migrate-every` steps, every
  `--fault-every`-th of them failing in its transfer (it must roll back on every rank), a checkpoint every
  `--save-every` steps;
- disturbed: the same, but rank 1 SIGKILLs itself after step `--kill-at`; the job must exit non-zero, and a
  second launch resumes from the latest checkpoint and finishes.
It prints (and writes to OUT/soak.json, with a plot OUT/soak.png): steps done, migrations attempted / committed /
rolled back, resumes, and the largest loss gap between the two runs over all steps (target 0: the resume is
exact and the faults are the same in both).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ds_cobalt.commands.arg_types import positive_int

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default=str(REPO / "ds_config_templates" / "cpu_2nodes_x_2ranks.json"))
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--migrate-every", type=int, default=10)
    p.add_argument("--fault-every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=137)
    p.add_argument("--rate", default=None, help="emulated inter-node link (run_cluster.sh), e.g. 100mbit")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, run_dir: Path, kill_at: int) -> int:
    """One launch of soak_job.py; its exit code."""
    job = ["--deepspeed_config", args.deepspeed_config, "--steps", str(args.steps), "--save-every",
           str(args.save_every), "--migrate-every", str(args.migrate_every), "--fault-every", str(args.fault_every),
           "--kill-at", str(kill_at), "--ckpt", str(run_dir / "ckpt"), "--log", str(run_dir / "log.jsonl")]
    script = str(REPO / "benchmarks" / "soak_job.py")
    if args.rate:
        cmd = ["bash", str(REPO / "benchmarks" / "cluster" / "run_cluster.sh"), "--rate", args.rate, "--script",
               script, "--", *job]
    else:
        deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
        cmd = [deepspeed, "--num_gpus", "4", "--master_port", str(_free_port()), script, *job]
    with open(run_dir / "launches.log", "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout,
                                  stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            return 124


def read_log(path: Path) -> dict:
    """Per step the last loss logged (a resumed launch replays the steps after its checkpoint), and per
    migration step the last outcome; launches."""
    losses: dict[int, float] = {}
    migrations: dict[int, bool] = {}
    launches = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if "step" in event:
            losses[event["step"]] = event["loss"]
        elif "migration" in event:
            migrations[event["migration"]] = event["ok"]
        elif "launch" in event:
            launches.append(event["launch"])
    return {"losses": losses, "migrations": migrations, "launches": launches}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    runs = {name: out / name for name in ("undisturbed", "disturbed")}
    for d in runs.values():
        d.mkdir(parents=True)
    t0 = time.perf_counter()
    print(f"[soak] undisturbed run: {args.steps} steps", flush=True)
    codes = {"undisturbed": [launch(args, runs["undisturbed"], -1)]}
    if codes["undisturbed"] != [0]:
        sys.exit(f"[soak] the undisturbed run failed (exit {codes['undisturbed'][0]}); see "
                 f"{runs['undisturbed'] / 'launches.log'}")
    print(f"[soak] disturbed run: rank 1 killed after step {args.kill_at}", flush=True)
    codes["disturbed"] = [launch(args, runs["disturbed"], args.kill_at)]
    resumes = 0
    while codes["disturbed"][-1] != 0 and resumes < 3:
        resumes += 1
        print(f"[soak] launch exited with {codes['disturbed'][-1]}: resume {resumes}", flush=True)
        codes["disturbed"].append(launch(args, runs["disturbed"], args.kill_at))
    logs = {name: read_log(d / "log.jsonl") for name, d in runs.items()}
    u, d = logs["undisturbed"], logs["disturbed"]
    steps = sorted(set(u["losses"]) & set(d["losses"]))
    gaps = [abs(u["losses"][s] - d["losses"][s]) for s in steps]
    mig = d["migrations"]
    result = {
        "steps_done": max(d["losses"], default=0), "steps_target": args.steps, "exit_codes": codes,
        "resumes": resumes, "resumed_from_steps": [x["start_step"] for x in d["launches"][1:]],
        "migrations_attempted": len(mig), "migrations_committed": sum(mig.values()),
        "migrations_rolled_back": sum(not ok for ok in mig.values()),
        "undisturbed_migrations": {"attempted": len(u["migrations"]), "committed": sum(u["migrations"].values())},
        "largest_loss_gap": max(gaps, default=float("nan")), "steps_compared": len(steps),
        "wall_s": time.perf_counter() - t0,
    }
    print(f"soak: {result['steps_done']}/{args.steps} steps; exit codes {codes}; resumes {resumes} (from step "
          f"{result['resumed_from_steps']})")
    print(f"  migrations attempted {result['migrations_attempted']}, committed {result['migrations_committed']}, "
          f"rolled back {result['migrations_rolled_back']} (undisturbed run: {result['undisturbed_migrations']})")
    print(f"  largest loss gap to the undisturbed run over {len(steps)} steps: {result['largest_loss_gap']:.3g} "
          f"(target 0); {result['wall_s']:.0f} s")
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    _plot(u["losses"], d["losses"], args.kill_at, result["resumed_from_steps"], out / "soak.png")
    ok = (result["largest_loss_gap"] == 0 and result["steps_done"] == args.steps and resumes == 1
          and result["migrations_rolled_back"] > 0)
    sys.exit(0 if ok else 1)


def _plot(undisturbed: dict, disturbed: dict, kill_at: int, resumed_from: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for name, losses in (("undisturbed", undisturbed), ("disturbed (killed, resumed)", disturbed)):
        top.plot(sorted(losses), [losses[s] for s in sorted(losses)], label=name, lw=1)
    common = sorted(set(undisturbed) & set(disturbed))
    bottom.plot(common, [abs(undisturbed[s] - disturbed[s]) for s in common], color="tab:red")
    for ax in (top, bottom):
        ax.axvline(kill_at, color="grey", ls="--", lw=0.8)
        for s in resumed_from:
            ax.axvline(s, color="tab:green", ls=":", lw=0.8)
    top.set_ylabel("loss")
    top.legend()
    bottom.set_ylabel("|loss gap|")
    bottom.set_xlabel("optimizer step (grey: kill, green: resumed from)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
