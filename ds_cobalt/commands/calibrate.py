"""`ds-cobalt calibrate`: measure this machine's emulated-cluster numbers and write a hardware JSON.

Measured (as root, network namespaces joined by a `tc tbf`-limited veth, exactly as
benchmarks/cluster/run_cluster.sh builds them):
- inter-node goodput per rate: one TCP stream through the limited veth (bytes/s received);
- gloo all-to-all on loopback with `--world` ranks and node groups of `--ranks-per-node`: the fixed cost of
  a collective (overhead + latency per peer, from tiny messages) and intra-node bytes/s (large messages; with one
  rank per node, over all ranks);
- expert throughput: `--world` concurrent single-thread processes running an expert MLP forward + backward
  (the example's shape) on `--rows` rows, FLOP/s per process (so CPU sharing is included).
`--compare RUNS` compares measured step-time ratios of `benchmarks/e2e_cluster.py` runs with the simulator.
torch is imported only inside the measurement functions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP = "measure link rate, all-to-all cost and expert GEMM throughput; write a hardware JSON (emulated-cpu)"

_RECV = r"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}), flush=True)
"""
_SEND = r"""
import socket, sys, time
n = int(sys.argv[3]); buf = b"x" * (1 << 20)
for _ in range(200):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
while n > 0:
    s.sendall(buf[: min(n, len(buf))]); n -= len(buf)
s.close()
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/calibration/emulated-cpu.json", help="hardware JSON to write")
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"],
                        help="tc rates of the inter-node link to measure")
    parser.add_argument("--default-rate", default="1gbit", help="rate whose goodput becomes inter_node_bw_*")
    parser.add_argument("--skip-link", action="store_true", help="do not measure the veth link (no root)")
    parser.add_argument("--world", type=int, default=4, help="ranks of the emulated cluster")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="expert hidden size (train_moe.py --d-model)")
    parser.add_argument("--ffn", type=int, default=128, help="expert intermediate size (train_moe.py --d-ff)")
    parser.add_argument("--rows", type=int, default=1024, help="rows per expert call")
    parser.add_argument("--compare", metavar="RUNS_DIR", default=None,
                        help="instead of measuring: compare benchmarks/e2e_cluster.py runs with the simulator")
    parser.add_argument("--hardware-json", default=None, help="hardware for --compare (default: emulated-cpu)")
    parser.add_argument("--json-out", default=None, help="with --compare: write the comparison JSON here")


def run(args: argparse.Namespace) -> int:
    if args.compare:
        from ..sim.hardware import get_hardware, load_hardware_json
        from ..sim.report_compare import compare_runs, format_comparison

        hw = load_hardware_json(args.hardware_json) if args.hardware_json else get_hardware("emulated-cpu")
        result = compare_runs(args.compare, hw)
        print(format_comparison(result))
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    from ..sim.hardware import Hardware, parse_rate, save_hardware_json

    for flag, value, low in (("--world", args.world, 2), ("--ranks-per-node", args.ranks_per_node, 1),
                             ("--hidden", args.hidden, 1), ("--ffn", args.ffn, 1), ("--rows", args.rows, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.world % args.ranks_per_node:
        raise ValueError(f"--world {args.world} is not a multiple of --ranks-per-node {args.ranks_per_node}")
    for flag, rates in (("--rates", args.rates), ("--default-rate", [args.default_rate])):
        for rate in rates:  # a bad rate fails before minutes of measuring
            try:
                parse_rate(rate)
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
    link: dict[str, float] = {}
    if not args.skip_link:
        for rate in args.rates:
            link[rate] = measure_link(rate)
            print(f"[calibrate] link {rate}: {link[rate] / 1e6:.2f} MB/s ({link[rate] / parse_rate(rate):.3f} "
                  f"of nominal)", flush=True)
    comm = measure_workers(args.world, args.ranks_per_node, args.hidden, args.ffn, args.rows)
    print(f"[calibrate] workers: {json.dumps(comm)}", flush=True)
    default_bw = link.get(args.default_rate, parse_rate(args.default_rate))
    hw = Hardware(
        name="emulated-cpu", gpus_per_node=args.ranks_per_node, inter_node_bw_gpu=default_bw,
        inter_node_bw_node=default_bw, intra_node_bw=comm["intra_bytes_per_s"], latency_s=comm["latency_s"],
        collective_overhead_s=comm["overhead_s"], gemm_flops=comm["gemm_flops"], overlap=False,
        source=f"ds-cobalt calibrate on {os.uname().nodename} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}: "
               f"TCP through a tbf veth, gloo all-to-all with {args.world} ranks on loopback, "
               f"{args.world} concurrent expert MLPs {args.hidden}x{args.ffn}",
        link_rates=link,
    )
    save_hardware_json(hw, args.out)
    print(f"[calibrate] wrote {args.out}")
    return 0


def measure_link(rate: str, seconds: float = 1.5) -> float:
    """Goodput (bytes/s) of one TCP stream through a veth limited with `tc tbf rate RATE` (needs root)."""
    from ..sim.hardware import parse_rate

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise ValueError("measuring the link needs root and iproute2 (ip, tc); pass --skip-link")
    tag = f"cal{os.getpid() % 100000}"
    ns = [f"{tag}n0", f"{tag}n1"]
    dev = [f"{tag}a0", f"{tag}a1"]
    nbytes = int(min(max(parse_rate(rate) * seconds, 4 << 20), 512 << 20))

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    try:
        for n in ns:
            sh("ip", "netns", "add", n)
            sh("ip", "-n", n, "link", "set", "lo", "up")
        sh("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in (0, 1):
            sh("ip", "link", "set", dev[i], "netns", ns[i])
            sh("ip", "-n", ns[i], "addr", "add", f"10.78.0.{i + 1}/24", "dev", dev[i])
            sh("ip", "-n", ns[i], "link", "set", dev[i], "up")
            # same qdisc as benchmarks/cluster/run_cluster.sh
            sh("tc", "-n", ns[i], "qdisc", "add", "dev", dev[i], "root", "tbf", "rate", rate, "burst", "512kb",
               "latency", "100ms")
        port = "29877"
        server = subprocess.Popen(["ip", "netns", "exec", ns[1], sys.executable, "-c", _RECV, port],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        server.stdout.readline()  # "ready"
        subprocess.run(["ip", "netns", "exec", ns[0], sys.executable, "-c", _SEND, "10.78.0.2", port, str(nbytes)],
                       check=True, timeout=120)
        out = json.loads(server.stdout.readline())
        server.wait(timeout=30)
        return out["bytes"] / out["seconds"]
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def measure_workers(world: int, ranks_per_node: int, hidden: int, ffn: int, rows: int) -> dict[str, float]:
    """Spawn `world` gloo ranks on loopback; return the mean over ranks of the measured numbers."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        port = 29600 + os.getpid() % 300
        mp.spawn(_worker, args=(world, ranks_per_node, hidden, ffn, rows, port, tmp), nprocs=world, join=True)
        results = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    out = {k: sum(r[k] for r in results) / world for k in results[0]}
    # Fixed cost of a collective = overhead + latency * peers, fitted on 1 peer (node group) and W - 1 peers.
    t_node, t_world = out.pop("tiny_node_s"), out.pop("tiny_world_s")
    peers_node, peers_world = ranks_per_node - 1, world - 1
    latency = max(0.0, (t_world - t_node) / max(peers_world - peers_node, 1))
    out["latency_s"] = latency
    out["overhead_s"] = max(0.0, t_node - latency * peers_node)
    return out


def _worker(rank: int, world: int, G: int, hidden: int, ffn: int, rows: int, port: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = [dist.new_group(list(range(n * G, (n + 1) * G))) for n in range(world // G)]
    node = groups[rank // G]

    def timed(fn, iters: int) -> float:
        dist.barrier()
        fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    tiny_w, tiny_n = torch.zeros(world, dtype=torch.int64), torch.zeros(G, dtype=torch.int64)
    res = {
        "tiny_world_s": timed(lambda: dist.all_to_all_single(torch.empty_like(tiny_w), tiny_w), 200),
        "tiny_node_s": timed(lambda: dist.all_to_all_single(torch.empty_like(tiny_n), tiny_n, group=node), 200),
    }
    # one rank per node has no node peers: the same loopback all-to-all over all ranks stands for the node's link
    peers, n, tiny = (node, G, res["tiny_node_s"]) if G > 1 else (None, world, res["tiny_world_s"])
    big = torch.randn(n * (1 << 19))  # 2 MiB to every peer
    t_big = timed(lambda: dist.all_to_all_single(torch.empty_like(big), big, group=peers), 10)
    res["intra_bytes_per_s"] = big.numel() * 4 * (n - 1) / n / max(t_big - tiny, 1e-9)
    # Expert MLP forward + backward, all ranks at once (they share the CPU cores as in a run).
    mlp = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
    x = torch.randn(rows, hidden, requires_grad=True)

    def step() -> None:
        mlp(x).sum().backward()

    t_mlp = timed(step, 50)
    res["gemm_flops"] = 3 * 2 * 2 * hidden * ffn * rows / t_mlp
    Path(tmp, f"{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
