"""A short timed probe of the EP groups: fixed cost per collective and bytes/s inside a node and across nodes.

Run once per set of groups (cached), on every rank of the EP group at the same point (it is collective):
- fixed cost: an all-to-all of one int64 per peer over the EP group;
- across nodes: an all-to-all over the EP group of `probe_bytes` to each other node (split over its ranks; none
  to this node's ranks), so all ranks of a node load its link at once, as the exchanges do; bytes/s = bytes this rank
  sends / (time - fixed cost), 4x larger until the transfer takes `TRANSFER_OVER_FIXED` times the fixed cost (at
  most `max_bytes`);
- inside a node: `probe_bytes` to each peer on the node group, likewise.
Each is the fastest of `repeats` timed calls after one warm-up: on a shared machine other work only ever slows a
call down, so the fastest is the link's own time (the median of 3 moved 2x between jobs at loopback here, and the
cost model then priced dense's extra bytes as a clear loss). The slowest rank's numbers are agreed by one
all-reduce (MAX of the times), so every rank holds the same `LinkCosts`. The migration cost model reads its
link speed from here (unless `migration.inter_node_gbps` is set), and the numbers are logged and reported.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .comm import group_size, slowest_rank
from .topology import EPGroups

_CACHE: dict[tuple, "LinkCosts"] = {}
# a bandwidth probe grows (x4, up to `max_bytes`) until its transfer takes this many times the fixed cost: a short
# one is within the noise of the fixed cost and fits a link's burst allowance (the testbed's tbf lets 512 KiB
# through at once: 256 KiB per rank read 0.55-1.24 Gbit/s on the 2 x 2 cluster at 1 Gbit/s, 1 MiB 0.50-0.53 and
# 4 MiB 0.47-0.49, its sustained share of the node's link)
TRANSFER_OVER_FIXED = 4.0


@dataclass(frozen=True)
class LinkCosts:
    """What the probe measured (slowest rank). Bandwidths are per rank and direction; `inf` where a stage
    has no peers (one node, or one rank per node)."""

    fixed_s: float  # one small collective over the EP group
    inter_node_bytes_per_s: float  # with every rank of the node sending across at once
    intra_node_bytes_per_s: float
    probe_bytes: int  # bytes each rank sent to each other node in the last cross-node probe

    @property
    def inter_node_gbps(self) -> float:
        return self.inter_node_bytes_per_s * 8 / 1e9

    def to_dict(self) -> dict:
        return asdict(self)


def _timed_all_to_all(numel: int, group: dist.ProcessGroup | None, device: torch.device, repeats: int,
                      to_peer: Sequence[bool] | None = None) -> float:
    """Fastest of `repeats` timed all-to-alls (after one warm-up) of `numel` bytes to each peer of `group`, or
    only to the group ranks where `to_peer` is true (and from them: `to_peer` must be symmetric)."""
    peers = group_size(group)
    if group is None or peers == 1:
        return 0.0
    splits = [numel if send_to else 0 for send_to in (to_peer if to_peer is not None else [True] * peers)]
    send = torch.zeros(sum(splits), dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host sync (probe only)
        start = time.perf_counter()
        dist.all_to_all_single(recv, send, splits, splits, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call is a warm-up
            times.append(time.perf_counter() - start)
    return min(times)


def probe_links(groups: EPGroups, device: torch.device, probe_bytes: int = 256 << 10, repeats: int = 5,
                max_bytes: int = 4 << 20) -> LinkCosts:
    """The cached `LinkCosts` of `groups` (module docstring); collective on the EP group the first time."""
    key = (groups.ep_ranks, groups.topology.ranks_per_node, probe_bytes, device.type)
    if key in _CACHE:
        return _CACHE[key]
    topo = groups.topology
    G = topo.ranks_per_node
    # across nodes: one all-to-all over the EP group in which every rank sends to the ranks of the other nodes only
    # (`probe_bytes / G` to each, so `probe_bytes` per other node), and all ranks of a node load its link at once,
    # as in the exchanges: a probe on one rail group read up to 2x the rate where the other rails' calls did not
    # overlap it; inside a node: the node group
    other_node = [r // G != topo.node for r in range(topo.world_size)]
    stages = ((groups.ep_group if topo.nodes > 1 else None, other_node, G), (groups.node_group, None, 1))
    sizes = [probe_bytes, probe_bytes]

    def timed(i: int) -> float:
        group, to_peer, per_peer_divisor = stages[i]
        return _timed_all_to_all(max(1, sizes[i] // per_peer_divisor), group, device, repeats, to_peer)

    fixed = _timed_all_to_all(8, groups.ep_group, device, repeats)
    fixed, *times = slowest_rank([fixed, timed(0), timed(1)], groups.ep_group).tolist()  # NOTE: host sync (probe only)
    while True:  # every rank decides on the same agreed times, so all run the same calls
        grow = [i for i, (t, n) in enumerate(zip(times, sizes))
                if t > 0 and t - fixed < TRANSFER_OVER_FIXED * fixed and n < max_bytes]
        if not grow:
            break
        for i in grow:
            sizes[i] *= 4
            times[i] = timed(i)
        times = slowest_rank(times, groups.ep_group).tolist()

    def rate(seconds: float, sent_bytes: int) -> float:
        if sent_bytes <= 0 or seconds <= 0:
            return float("inf")
        return sent_bytes / max(seconds - fixed, seconds * 0.05)

    costs = LinkCosts(fixed_s=fixed, inter_node_bytes_per_s=rate(times[0], max(1, sizes[0] // G) * sum(other_node)),
                      intra_node_bytes_per_s=rate(times[1], sizes[1] * (G - 1)), probe_bytes=sizes[0])
    _CACHE[key] = costs
    return costs
