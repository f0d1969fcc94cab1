"""Planner speed against a fixed baseline commit, single core, measured side by side in one run.

    python benchmarks/planner_speed.py [--baseline-commit 374f1c7] [--repeat 3]

The baseline planner (`ds_cobalt/planner/*.py` at the commit, read with `git show`) is written to a temporary
package `cobalt_baseline.planner` and imported next to the working tree's `ds_cobalt.planner`; both plan the
same inputs. Rows (targets of issue 13):
- `cobalt` policy, one layer: E=256, k=8, 8 nodes x 8 GPUs, R=1, 16k sample tokens (target <= 1 s);
- stage 1 (`plan_nodes`, partitioner auto / fast / greedy): E=256 on 32 x 8 GPUs (32 nodes, one expert per
  GPU), 64k tokens (target < 1 s for auto);
- `assign_tasks`: 128k tokens (8 GPUs x 16k) of E=256 on 8 x 8 GPUs, R=1 (target <= 10 ms), and 16k tokens.
New code: compiled kernels are loaded (or compiled, first run only) by a warm-up on a small input, timed apart;
then best of `--repeat` runs (10 for the millisecond rows). Baseline: the same for the millisecond rows, one
run for the slow ones.
"Same output" compares the two results exactly (they differ only where the baseline broke ties with an
unstable sort or used multi-threaded Mt-KaHyPar). Wall seconds; CPU seconds of this process in brackets
(the machine may be shared: the load average is printed before and after).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # single core, set before numpy / numba load

import argparse  # noqa: E402
import importlib  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

import ds_cobalt.planner.assign as new_assign  # noqa: E402
import ds_cobalt.planner.policies as new_policies  # noqa: E402
import ds_cobalt.planner.stage1 as new_stage1  # noqa: E402
import ds_cobalt.planner.stage2 as new_stage2  # noqa: E402
import ds_cobalt.planner.stats as new_stats  # noqa: E402
from ds_cobalt.sim.synth import synth_trace  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_baseline(commit: str) -> dict[str, Any] | None:
    """The planner modules at `commit` as `cobalt_baseline.planner.*` (None if git cannot read them)."""
    try:
        names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", commit, "ds_cobalt/planner/"],
                               check=True, capture_output=True, text=True).stdout.split()
        root = pathlib.Path(tempfile.mkdtemp(prefix="cobalt_baseline_"))
        pkg = root / "cobalt_baseline" / "planner"
        pkg.mkdir(parents=True)
        (root / "cobalt_baseline" / "__init__.py").write_text("")
        for name in names:
            if name.endswith(".py"):
                src = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{name}"], check=True,
                                     capture_output=True, text=True).stdout
                (pkg / pathlib.Path(name).name).write_text(src)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"baseline {commit!r} unavailable ({exc}); new code only", file=sys.stderr)
        return None
    sys.path.insert(0, str(root))
    mods = ("assign", "policies", "stage1", "stage2", "stats")
    return {m: importlib.import_module(f"cobalt_baseline.planner.{m}") for m in mods}


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(best wall s, CPU s of that run, result of the last run)."""
    best, cpu, out = np.inf, np.inf, None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        w, c = time.perf_counter() - w0, time.process_time() - c0
        if w < best:
            best, cpu = w, c
    return best, cpu, out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    return bool(np.array_equal(a, b))


def layer_input(mods: dict[str, Any], topk: np.ndarray, src: np.ndarray, N: int, G: int, R: int) -> Any:
    E = int(topk.max()) + 1
    return mods["policies"].LayerInput(stats=mods["stats"].RoutingStats.from_topk(topk, E), topk_ids_TK=topk,
                                       source_rank_T=src, nodes=N, gpus_per_node=G, redundant_slots=R)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-commit", default="374f1c7")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rep = max(1, args.repeat)
    new = {"assign": new_assign, "policies": new_policies, "stage1": new_stage1, "stage2": new_stage2,
           "stats": new_stats}
    base = load_baseline(args.baseline_commit)
    load0 = os.getloadavg()

    # Warm-up: load (or, on a first run, compile) the kernels on a small layer.
    w0 = time.perf_counter()
    small = synth_trace(num_experts=32, top_k=4, num_tokens=800, seed=1)
    inp = layer_input(new, small.experts_LTK[0], small.source_ranks(8), 2, 4, 1)
    new_policies.plan_layer("cobalt", inp)
    new_policies.plan_layer("pairwise", inp)
    warm = time.perf_counter() - w0

    rows: list[tuple[str, str, float | None, tuple[float, float], bool | None, bool]] = []

    def row(what: str, target: str, limit: float, fn: Callable[[dict], Any], base_repeat: int,
            new_repeat: int = rep) -> None:
        t_new, c_new, out_new = timed(lambda: fn(new), new_repeat)
        t_base, match = None, None
        if base is not None:
            t_base, _, out_base = timed(lambda: fn(base), base_repeat)
            match = same(out_base, out_new)
        rows.append((what, target, t_base, (t_new, c_new), match, t_new <= limit))
        print(f"  measured: {what}", file=sys.stderr, flush=True)

    # The cobalt policy, one layer.
    tr = synth_trace(num_experts=256, top_k=8, num_tokens=16384, gini=0.5, clustering=0.7, seed=7)
    topk, src = tr.experts_LTK[0], tr.source_ranks(64)
    inputs: dict[int, Any] = {}

    def cobalt(mods: dict) -> np.ndarray:
        key = id(mods)
        if key not in inputs:
            inputs[key] = layer_input(mods, topk, src, 8, 8, 1)
        return mods["policies"].plan_layer("cobalt", inputs[key])

    row("`cobalt` policy, E=256 k=8 8x8 GPUs R=1, 16k tokens", "<= 1 s", 1.0, cobalt, 1)

    # Stage 1 alone: 32 nodes x 8 GPUs, one expert per GPU.
    tr = synth_trace(num_experts=256, top_k=8, num_tokens=65536, gini=0.4, clustering=0.6, seed=0)
    st = new_stats.RoutingStats.from_topk(tr.experts_LTK[0], 256)
    for part in ("auto", "fast", "greedy"):
        def stage1(mods: dict, part: str = part) -> np.ndarray:
            return mods["stage1"].plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, 32, partitioner=part)

        row(f"stage 1 `plan_nodes` ({part}), E=256 k=8 32 nodes, 64k tokens",
            "< 1 s" if part == "auto" else "(info)", 1.0, stage1, 1)

    # Task assignment: the tokens of one node's 8 GPUs (16k each) and of one GPU.
    E, N, G, R, T = 256, 8, 8, 1, 8 * 16384
    tr = synth_trace(num_experts=E, top_k=8, num_tokens=T, gini=0.4, clustering=0.6, seed=1)
    topk = tr.experts_LTK[0]
    st = new_stats.RoutingStats.from_topk(topk, E)
    node_of_E = new_stage1.plan_nodes(st.load_E, st.coact_EE, st.sets_MK, st.count_M, N, partitioner="greedy")
    load_NE = np.zeros((N, E))
    load_NE[node_of_E, np.arange(E)] = st.load_E
    slots = new_stage2.plan_gpus(node_of_E, np.zeros((N, E), bool), load_NE, G, R)
    src = np.repeat(np.arange(G), T // G)
    fast_rep = max(rep, 10)  # milliseconds: more runs, less noise from other processes
    row("`assign_tasks`, 128k tokens (8 GPUs x 16k), E=256 8x8 R=1", "<= 10 ms", 0.010,
        lambda mods: mods["assign"].assign_tasks(topk, src, slots, G), fast_rep, fast_rep)
    row("`assign_tasks`, 16k tokens (one GPU)", "(info)", np.inf,
        lambda mods: mods["assign"].assign_tasks(topk[: T // G], src[: T // G], slots, G), fast_rep, fast_rep)

    load1 = os.getloadavg()
    print(f"Planner speed, commit {args.baseline_commit} (baseline) vs working tree (new); {os.cpu_count()} CPUs, "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after; OMP/NUMBA threads = 1; kernel warm-up "
          f"{warm:.2f} s (cache load, or compile on a first run).\n")
    print("| what | target | baseline s | new s (CPU s) | speed-up | target met | same output |")
    print("|---|---|---|---|---|---|---|")
    for what, target, t_base, (t_new, c_new), match, met in rows:
        b = "-" if t_base is None else f"{t_base:.4f}"
        ratio = "-" if t_base is None else f"{t_base / t_new:.1f}x"
        m = "-" if match is None else ("yes" if match else "no")
        ok = "-" if target == "(info)" else ("yes" if met else "**no**")
        print(f"| {what} | {target} | {b} | {t_new:.4f} ({c_new:.4f}) | {ratio} | {ok} | {m} |")


if __name__ == "__main__":
    main()
