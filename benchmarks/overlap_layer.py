"""One MoE layer, forward + backward, on every rank: DeepSpeed's layer vs ds_cobalt without and with overlap.

Run under the real launcher (4 CPU ranks as 2 nodes x 2 here; or inside benchmarks/cluster/run_cluster.sh
with `--script benchmarks/overlap_layer.py` for a bandwidth-limited inter-node link):

    deepspeed --num_gpus 4 benchmarks/overlap_layer.py --ranks-per-node 2

Prints, from rank 0, median times over `--iters` iterations measured back to back in one run (DeepSpeed's layer,
ds_cobalt's hierarchical schedule with and without overlap, direct, dense), collectives and host syncs per layer
forward / backward for each, and ratios:
overlap on vs off, vs DeepSpeed's layer, and vs the lower bound max(communication, compute), where
communication is the same exchange with identity experts and compute is the experts alone on the rows
this rank serves (both measured in the same run, slowest rank). The phased communication time includes
the gaps between its phases, which the chunked schedule overlaps; with `--link-mbit` (the emulated link's
rate) the script also prints the wire time of the inter-node bytes and the ratio to max(wire, compute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

import ds_cobalt
from ds_cobalt.config import parse_cobalt_config
from ds_cobalt.runtime.call_counts import count_collectives, count_host_syncs
from ds_cobalt.runtime.dispatch import combine, dispatch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tile-rows", type=int, default=512)
    p.add_argument("--rail-chunks", type=int, default=2, help="cobalt.overlap.rail_chunks")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--link-mbit", type=float, default=None,
                   help="inter-node link rate per direction (run_cluster.sh --rate); adds the wire-time bound")
    p.add_argument("--metrics-out", "--json-out", dest="json_out", type=str, default=None,
                   help="write the times and ratios as JSON (rank 0)")
    p.add_argument("--local_rank", type=int, default=0)  # set by the deepspeed launcher
    return p.parse_args()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn, iters: int, warmup: int) -> float:
    """Median over iterations of the slowest rank's time for `fn()`."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = slowest(time.perf_counter() - start)
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def call_counts(layer, x: torch.Tensor) -> dict:
    """Collectives and host syncs of one forward and one backward (`ds_cobalt.runtime.call_counts`)."""
    inp = x.clone().requires_grad_(True)
    with count_collectives() as fwd, count_host_syncs() as fwd_syncs:
        out, l_aux, _ = layer(inp)
    with count_collectives() as bwd, count_host_syncs() as bwd_syncs:
        (out.square().mean() + l_aux).backward()
    return {"collectives": [sum(fwd.values()), sum(bwd.values())],
            "syncs": [sum(fwd_syncs.values()), sum(bwd_syncs.values())]}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    D, E = args.hidden, args.experts
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D, args.ffn), torch.nn.GELU(), torch.nn.Linear(args.ffn, D))
    kw = dict(ep_size=world, k=args.top_k, drop_tokens=False, min_capacity=0)
    layers = {"deepspeed": DeepSpeedMoE(D, expert, E, **kw)}
    for name, overlap, schedule in (("cobalt", False, "hierarchical"), ("cobalt_overlap", True, "hierarchical"),
                                    ("cobalt_direct", False, "direct"), ("cobalt_dense", False, "dense")):
        cfg = parse_cobalt_config({"topology": {"ranks_per_node": args.ranks_per_node},
                                   "overlap": {"enabled": overlap, "tile_rows": args.tile_rows,
                                               "rail_chunks": args.rail_chunks},
                                   "transport": {"schedule": schedule}})
        layers[name] = ds_cobalt.MoE(D, expert, E, cobalt_config=cfg, **kw)
        layers[name].load_state_dict(layers["deepspeed"].state_dict())
    for layer in layers.values():
        layer.set_deepspeed_parallelism()
    x = torch.randn(args.tokens, D, generator=torch.Generator().manual_seed(rank))

    def step(layer) -> None:
        inp = x.clone().requires_grad_(True)
        out, l_aux, _ = layer(inp)
        (out.square().mean() + l_aux).backward()

    results = {name: timed(lambda layer=layer: step(layer), args.iters, args.warmup) for name, layer in layers.items()}
    calls = {name: call_counts(layer, x) for name, layer in layers.items()}

    # Lower bound parts, with the same routing as the cobalt layer.
    cobalt = layers["cobalt"]
    gate = cobalt.deepspeed_moe.gate
    _, _, _, ids_KT, _, w_KT, _ = gate(x, None, True, False)
    groups, placement = cobalt.cobalt_core.groups, cobalt.cobalt_core.placement

    def comm_only() -> None:
        inp = x.clone().requires_grad_(True)
        rows, handle = dispatch(inp, ids_KT.t().long(), w_KT.t().detach(), placement, groups)
        combine(rows * 1.0, handle, groups).sum().backward()

    rows_QD, handle = dispatch(x, ids_KT.t().long(), w_KT.t().detach(), placement, groups)
    experts = list(cobalt.deepspeed_moe.experts.deepspeed_experts)

    def compute_only() -> None:
        rows = rows_QD.detach().requires_grad_(True)
        outs = [e(chunk) for e, chunk in zip(experts, rows.split(list(handle.slot_counts)))]
        torch.cat(outs).sum().backward()

    results["communication"] = timed(comm_only, args.iters, args.warmup)
    results["compute"] = timed(compute_only, args.iters, args.warmup)
    bound = max(results["communication"], results["compute"])
    if args.link_mbit:
        # Wire time: the overlapped layer's inter-node bytes per fwd+bwd (backward sends what forward received),
        # spread evenly over the nodes' egress links: a floor no schedule can beat.
        totals = layers["cobalt_overlap"].traffic.totals()
        sent = torch.tensor([totals["inter_node_bytes"] / max(1, totals["steps"])], dtype=torch.float64)
        dist.all_reduce(sent)
        nodes = world // cobalt.topology.ranks_per_node
        results["wire"] = float(sent) * 2 * 8 / (nodes * args.link_mbit * 1e6)
        bound = max(bound, results["wire"])
    ratios = {
        "overlap_on_over_off": results["cobalt_overlap"] / results["cobalt"],
        "overlap_on_over_deepspeed": results["cobalt_overlap"] / results["deepspeed"],
        "overlap_off_over_deepspeed": results["cobalt"] / results["deepspeed"],
        "overlap_on_over_lower_bound": results["cobalt_overlap"] / bound,
    }
    if "wire" in results:
        wire_or_compute = max(results["wire"], results["compute"])
        ratios["overlap_on_over_max_wire_compute"] = results["cobalt_overlap"] / wire_or_compute
    if rank == 0:
        print(f"one MoE layer fwd+bwd, {world} ranks, {args.tokens} tokens/rank, D={D}, F={args.ffn}, "
              f"E={E}, k={args.top_k}; median of {args.iters} (slowest rank)")
        for name, seconds in results.items():
            print(f"  {name:>16}: {seconds * 1e3:8.2f} ms")
        for name, value in ratios.items():
            print(f"  {name:>28}: {value:.3f}")
        print(f"  {'per layer':>16}  collectives fwd/bwd   host syncs fwd/bwd")
        for name, c in calls.items():
            (cf, cb), (sf, sb) = c["collectives"], c["syncs"]
            print(f"  {name:>16}: {cf:>6} / {cb:<10}{sf:>6} / {sb}")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"seconds": results, "ratios": ratios, "calls_per_layer": calls, "args": vars(args)}, f,
                          indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
