"""The re-planning worker process: plans a share of the layers outside the training process.

    python -m ds_cobalt.planner.worker --policy cobalt [--policy-module mypkg.policies]
    python -m ds_cobalt.planner.worker --warm-up     # compile the numba kernels once (scripts/setup.sh)

Legend: E experts, K top-k, W EP ranks, S slots per rank, T sample tokens.

Protocol (one JSON object per line on stdout; requests are file paths on stdin, one per line):
- at start-up, after importing the policy's module and planning one tiny layer (loads the numba kernels):
  `{"ready": true}` or `{"ready": false, "error": "..."}` (then it exits);
- per request `<path>` (written by `write_request`): the decisions go to `<path>.result.npz` (written to a
  temporary name and renamed, so a reader never sees half a file), then `{"done": "<path>", "seconds": s}` or
  `{"done": "<path>", "error": "<traceback>"}`.
- end of stdin: it exits (`ProcessPlanner.close` kills it instead, which costs less CPU). It also dies with its
  parent (Linux `PR_SET_PDEATHSIG`), so a killed rank leaves no planner behind.

Files are plain `.npz` arrays read with `allow_pickle=False`: nothing here unpickles anything.
The worker runs at a lower CPU priority (`os.nice`), so it takes cycles the training ranks leave idle first.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .decisions import LayerDecision, LayerStats, plan_layer_decision
from .files import write_atomically
from .migration import LinkModel

__all__ = ["PlanParams", "write_request", "read_request", "plan_request", "write_result", "read_result",
           "plan_layers", "NICE"]

NICE = 10  # CFS weight ~1/10 of a training rank's when the cores are contended
PlanParams = dict[str, Any]  # nodes, gpus_per_node, policy, redundant_slots, seed, interval, ignore_cost_model, link


def plan_layers(layer_ids: list[int], stats: list[LayerStats], currents: list[np.ndarray], tokens_per_step: list[float],
                params: PlanParams) -> dict[int, LayerDecision]:
    """Pure: the decision for each listed layer (what the worker runs; the thread mode calls it directly)."""
    link = LinkModel(**params["link"])
    return {lid: plan_layer_decision(st, cur, nodes=params["nodes"], gpus_per_node=params["gpus_per_node"],
                                     policy=params["policy"], redundant_slots=params["redundant_slots"],
                                     seed=params["seed"], link=link, interval=params["interval"],
                                     tokens_per_step=tps, ignore_cost_model=params["ignore_cost_model"])
            for lid, st, cur, tps in zip(layer_ids, stats, currents, tokens_per_step)}


def _atomic_savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    write_atomically(path, write, durable=False)  # a request or result between two live processes


def write_request(path: Path, layer_ids: list[int], stats: list[LayerStats], currents: list[np.ndarray],
                  tokens_per_step: list[float], params: PlanParams) -> None:
    arrays: dict[str, np.ndarray] = {"params": np.array(json.dumps(params)),
                                     "layer_ids": np.asarray(layer_ids, dtype=np.int64),
                                     "tokens_per_step": np.asarray(tokens_per_step, dtype=np.float64)}
    for lid, st, cur in zip(layer_ids, stats, currents):
        arrays |= {f"{lid}.load_E": st.load_E, f"{lid}.coact_EE": st.coact_EE, f"{lid}.tokens": np.int64(st.tokens),
                   f"{lid}.samples_TK": st.samples_TK, f"{lid}.source_rank_T": st.source_rank_T,
                   f"{lid}.current_WS": cur}
    _atomic_savez(path, arrays)


def read_request(path: Path) -> tuple[list[int], list[LayerStats], list[np.ndarray], list[float], PlanParams]:
    with np.load(path, allow_pickle=False) as f:
        ids = [int(i) for i in f["layer_ids"]]
        stats = [LayerStats(f[f"{i}.load_E"], f[f"{i}.coact_EE"], int(f[f"{i}.tokens"]), f[f"{i}.samples_TK"],
                            f[f"{i}.source_rank_T"]) for i in ids]
        return ids, stats, [f[f"{i}.current_WS"] for i in ids], f["tokens_per_step"].tolist(), \
            json.loads(str(f["params"]))


def write_result(path: Path, decisions: dict[int, LayerDecision]) -> None:
    arrays: dict[str, np.ndarray] = {"layer_ids": np.asarray(list(decisions), dtype=np.int64)}
    for lid, d in decisions.items():
        arrays |= {f"{lid}.action": np.int64(d.action), f"{lid}.slots_WS": d.slots_WS,
                   f"{lid}.cross": np.array([d.old_cross, d.new_cross, d.saving_s])}
        if d.fallback_WS is not None:
            arrays[f"{lid}.fallback_WS"] = d.fallback_WS
    _atomic_savez(path, arrays)


def read_result(path: Path) -> dict[int, LayerDecision]:
    with np.load(path, allow_pickle=False) as f:
        out = {}
        for lid in (int(i) for i in f["layer_ids"]):
            old, new, saving = f[f"{lid}.cross"].tolist()
            fallback = f[f"{lid}.fallback_WS"] if f"{lid}.fallback_WS" in f.files else None
            out[lid] = LayerDecision(int(f[f"{lid}.action"]), f[f"{lid}.slots_WS"], old, new, saving, fallback)
        return out


def result_path(request: Path) -> Path:
    return request.with_name(request.name + ".result.npz")


def plan_request(request: Path) -> None:
    write_result(result_path(request), plan_layers(*read_request(request)))


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the line above ran
        sys.exit(1)


def warm_up(policy: str) -> None:
    """Plan one tiny layer, so the numba kernels are compiled (first install) or loaded from their cache."""
    rng = np.random.default_rng(0)
    E, K, W = 8, 2, 4
    samples = np.stack([rng.choice(E, K, replace=False) for _ in range(64)])
    stats = LayerStats(np.bincount(samples.ravel(), minlength=E).astype(np.float64), np.zeros((E, E)), 64, samples,
                       np.arange(64) % W)
    params = {"nodes": 2, "gpus_per_node": 2, "policy": policy, "redundant_slots": 1, "seed": 0, "interval": 10,
              "ignore_cost_model": True, "link": asdict(LinkModel())}
    plan_layers([0], [stats], [np.arange(E).reshape(W, -1)], [64.0], params)


def _say(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="cobalt")
    p.add_argument("--policy-module", default=None, help="module whose import registers the policy")
    p.add_argument("--warm-up", action="store_true", help="compile (or load) the numba kernels, then exit")
    args = p.parse_args(argv)
    if args.warm_up:
        t0 = time.perf_counter()
        warm_up("cobalt")
        print(f"[ds_cobalt.planner.worker] planner kernels ready ({time.perf_counter() - t0:.1f} s)")
        return 0
    _die_with_parent()
    os.nice(NICE)
    try:
        if args.policy_module:
            importlib.import_module(args.policy_module)
        from .policies import POLICIES

        if args.policy not in POLICIES:
            raise ValueError(f"policy {args.policy!r} is not registered after importing "
                             f"{args.policy_module or 'ds_cobalt.planner'}")
        warm_up("cobalt")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which plans in-process instead
        _say(ready=False, error=f"{type(e).__name__}: {e}")
        return 1
    _say(ready=True)
    for line in sys.stdin:
        request = Path(line.strip())
        t0 = time.perf_counter()
        try:
            plan_request(request)
            _say(done=str(request), seconds=time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - one bad request must not end the worker
            _say(done=str(request), error=traceback.format_exc())
    return 0


if __name__ == "__main__":
    sys.exit(main())
