"""Stage 2 every step vs the re-plan's replicas: per-step GPU load balance on replayed traces.

    python benchmarks/stage2_balance.py [--trace a.npz[:NODES:GPUS]] ... [--no-synth] [--steps 16]

Each trace is replayed step by step (`ds_cobalt.sim.replay`, what `ds-cobalt simulate --replay --stage2 MODE`
runs), re-planned every `--replan-interval` steps (owners move when the migration cost model says so), from two
starts with one spare slot per GPU: DeepSpeed's contiguous owners with empty spare slots, and a `cobalt` layout
planned on the first step's tokens of every source rank (its spare slots hold cross-node traffic copies, which
stage 2 keeps). Once per stage 2 mode, in this one run:
- `step`: each node refills its spare slots from the step's own loads (the runtime's default);
- `predicted`: refilled every step from the averaged statistics;
- `interval`: the re-plan's replicas stay until the next re-plan.
Prints a markdown table of the median per-step GPU load max/mean (target <= 1.05 for `step`), next to the median
per-step node load max/mean, which stage 2 cannot lower (it only moves rows inside a node). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ds_cobalt.commands.arg_types import positive_int
from ds_cobalt.planner.layout import Layout, contiguous_layout
from ds_cobalt.planner.policies import plan_layout
from ds_cobalt.planner.trace import load_trace
from ds_cobalt.sim.replay import STAGE2_MODES, replay, step_tokens
from ds_cobalt.sim.synth import synth_trace

RECORDED = "benchmarks/traces/stdlib_lm_e16_k4_steps290-300.npz:2:2"
SYNTH = [  # name, E, K, nodes, gpus/node, tokens, gini, clustering
    ("synth-E64-k6-2x4", 64, 6, 2, 4, 32768, 0.4, 0.5),
    ("synth-E64-k6-4x2", 64, 6, 4, 2, 32768, 0.4, 0.5),
    ("synth-E128-k8-4x4", 128, 8, 4, 4, 32768, 0.3, 0.5),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", default=[], help="recorded .npz trace, PATH or PATH:NODES:GPUS")
    ap.add_argument("--nodes", type=int, default=2, help="topology for --trace without a suffix")
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--no-synth", action="store_true",
                    help=f"only the recorded traces ({RECORDED} and those of --trace)")
    ap.add_argument("--steps", type=positive_int, default=16, help="steps each trace is cut into")
    ap.add_argument("--replan-interval", type=int, default=4)
    args = ap.parse_args()

    cases = []
    for spec in dict.fromkeys([RECORDED, *args.trace]):  # the recorded trace once, also when given with --trace
        path, *topo = spec.split(":")
        nodes, gpus = (int(topo[0]), int(topo[1])) if topo else (args.nodes, args.gpus_per_node)
        cases.append((path, load_trace(path), nodes, gpus))
    if not args.no_synth:
        for name, E, K, N, G, T, gini, clustering in SYNTH:
            cases.append((name, synth_trace(num_experts=E, top_k=K, num_tokens=T, gini=gini, clustering=clustering,
                                            seed=7), N, G))

    print(f"| trace | nodes x GPUs | E, k | start | {' | '.join(f'GPU max/mean, {m}' for m in STAGE2_MODES)} | "
          "node max/mean | cross-node tok/tok | seconds |")
    print("|---|---|---|---|" + "---|" * (len(STAGE2_MODES) + 3))
    for name, trace, N, G in cases:
        E = trace.num_experts
        contiguous = contiguous_layout(E, N, G).layer(0)
        empty_spare = np.concatenate([contiguous, np.full((N * G, 1), -1)], 1)
        # the first step of every source rank, as a re-plan after step 1 samples it (the first tokens in trace
        # order are the first source ranks' only where the trace is ordered by rank, as a recorded one is)
        first = trace.select_tokens(step_tokens(trace.source_ranks(N * G), N * G, args.steps)[0])
        starts = {"contiguous": Layout(E, N, G, np.repeat(empty_spare[None], trace.num_layers, 0)),
                  "cobalt": plan_layout(first, N, G, 1, "cobalt")}
        for start_name, layout in starts.items():
            start = time.perf_counter()
            reports = {mode: replay(trace, layout, steps=args.steps, replan_interval=args.replan_interval,
                                    stage2=mode) for mode in STAGE2_MODES}
            gpu = " | ".join(f"{reports[m]['step_gpu_load_max_over_mean_median']:.3f}" for m in STAGE2_MODES)
            step = reports["step"]
            print(f"| {name} | {N} x {G} | {E}, {trace.top_k} | {start_name} | {gpu} | "
                  f"{step['step_node_load_max_over_mean_median']:.3f} | "
                  f"{step['mean']['cross_node_tokens_per_token']:.3f} | {time.perf_counter() - start:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
