"""`ds_cobalt.MoE` against DeepSpeed's `MoE` on one device, forward + backward, every schedule.

    python3 benchmarks/gpu_moe_check.py [--device cuda] [--dtype bfloat16] [--tokens 4096] [--iters 20]

One rank in its own process group (NCCL on CUDA, gloo on CPU), so the collectives are local copies: this
checks the device path of the layer (kernels, dtypes, host syncs), not the network. For each case (schedule
hierarchical / direct / dense, replicas on or off, overlap on or off) both layers get the same weights and
inputs; the script compares outputs and every gradient and times forward + backward (CUDA events on CUDA).
On CUDA it also counts host syncs per forward with `torch.cuda.set_sync_debug_mode("warn")`.
Writes `$OUT/gpu_moe_check.json` and prints a table; exit code 1 if a case does not match.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CASES = [  # (name, schedule, replica slot, overlap)
    ("hierarchical", "hierarchical", False, False),
    ("hierarchical_replicas", "hierarchical", True, False),
    ("hierarchical_overlap", "hierarchical", False, True),
    ("hierarchical_overlap_replicas", "hierarchical", True, True),
    ("direct", "direct", False, False),
    ("direct_replicas", "direct", True, False),
    ("dense", "dense", False, False),
]


def _init(device: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def _timed(fn, device: str, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(sorted(times)[len(times) // 2])


def _host_syncs(fn, device: str) -> int | None:
    """Synchronizing CUDA calls in one `fn()` (torch's sync debug mode warns once per sync)."""
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def run_case(name: str, schedule: str, replicas: bool, overlap: bool, args) -> dict:
    import numpy as np
    import torch
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import ds_cobalt
    from ds_cobalt.config import parse_cobalt_config

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    D, E, k = args.hidden, args.experts, args.top_k
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D, args.ffn), torch.nn.GELU(), torch.nn.Linear(args.ffn, D))
    kwargs = dict(ep_size=1, k=k, drop_tokens=False, min_capacity=0)
    ref = DeepSpeedMoE(D, copy.deepcopy(expert), E, **kwargs)
    cfg = parse_cobalt_config({"transport": {"schedule": schedule}, "kernels": {"backend": args.kernels},
                               "overlap": {"enabled": overlap, "tile_rows": 512 if overlap else "auto"}})
    ours = ds_cobalt.MoE(D, copy.deepcopy(expert), E, cobalt_config=cfg, **kwargs)
    ours.load_state_dict(ref.state_dict())
    ref.to(device, dtype), ours.to(device, dtype)
    ref.set_deepspeed_parallelism()
    ours.set_deepspeed_parallelism()
    if replicas:  # a second copy of expert 0 on the one rank: routes of expert 0 split between the two
        ours.set_layout(np.concatenate([ours.layout_slots, [[0]]], axis=1))
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, D, device=device, generator=g).to(dtype)
    grad_out = torch.randn(args.tokens, D, device=device, generator=g).to(dtype)
    results = {}
    for label, layer in (("deepspeed", ref), ("cobalt", ours)):
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_(True)
        torch.manual_seed(7)
        out, l_aux, _ = layer(x_in)
        ((out.float() * grad_out.float()).sum() + l_aux).backward()
        results[label] = (out.detach().float(), x_in.grad.float(),
                          {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None})

        def step(layer=layer):
            xi = x.clone().requires_grad_(True)
            o, aux, _ = layer(xi)
            ((o.float() * grad_out.float()).sum() + aux).backward()

        results[f"{label}_ms"] = _timed(step, args.device, args.iters)
        results[f"{label}_syncs"] = _host_syncs(lambda layer=layer: layer(x), args.device)
    (o_ref, gx_ref, gp_ref), (o_our, gx_our, gp_our) = results["deepspeed"], results["cobalt"]
    diff = {"out": float((o_ref - o_our).abs().max()), "x_grad": float((gx_ref - gx_our).abs().max()),
            "param_grads": max(float((gp_ref[n] - gp_our[n]).abs().max()) for n in gp_ref)}
    scale = max(float(o_ref.abs().max()), 1e-6)
    tol = 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return {"case": name, "schedule": ours.cobalt_core.schedule,
            "kernels": ours.cobalt_core.backend(device), "max_abs_diff": diff,
            "ok": all(v <= tol * max(scale, 1.0) for v in diff.values()) and set(gp_ref) == set(gp_our),
            "deepspeed_ms": results["deepspeed_ms"], "cobalt_ms": results["cobalt_ms"],
            "deepspeed_host_syncs_per_forward": results["deepspeed_syncs"],
            "cobalt_host_syncs_per_forward": results["cobalt_syncs"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kernels", default=None, choices=["torch", "cupy", "auto"],
                   help="cobalt.kernels.backend (default: auto on CUDA, so the CuPy kernels run; torch on CPU)")
    args = p.parse_args(argv)
    args.kernels = args.kernels or ("auto" if args.device == "cuda" else "torch")
    _init(args.device)
    rows = []
    for case in CASES:
        try:
            rows.append(run_case(*case, args))
        except Exception as exc:  # a failing case is a result, the others still run
            rows.append({"case": case[0], "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(os.environ.get("OUT", "./gpu_results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_moe_check.json").write_text(json.dumps({"args": vars(args), "cases": rows}, indent=1))
    print(f"{'case':<32}{'ok':>4}{'DeepSpeed ms':>14}{'cobalt ms':>11}{'ratio':>7}{'syncs':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<32}{'no':>4}  {r['error'][:80]}")
            continue
        print(f"{r['case']:<32}{'yes' if r['ok'] else 'no':>4}{r['deepspeed_ms']:>14.2f}{r['cobalt_ms']:>11.2f}"
              f"{r['deepspeed_ms'] / r['cobalt_ms']:>7.2f}{str(r['cobalt_host_syncs_per_forward']):>7}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
