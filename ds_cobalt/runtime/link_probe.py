"""A short timed probe of the EP groups: fixed cost per collective and bytes/s inside a node and across nodes.

Run once per set of groups (cached), on every rank of the EP group at the same point (it is collective):
- fixed cost: an all-to-all of one int64 per peer over the EP group;
- across nodes: an all-to-all of `probe_bytes` per peer on the rail group (ranks with this local index on
  every node), bytes/s = bytes this rank sends / (time - fixed cost), 4x larger until the transfer takes
  `TRANSFER_OVER_FIXED` times the fixed cost (at most `max_bytes`);
- inside a node: the same on the node group.
Each is the fastest of `repeats` timed calls after one warm-up: on a shared machine other work only ever slows a
call down, so the fastest is the link's own time (the median of 3 moved 2x between jobs at loopback here, and the
cost model then priced dense's extra bytes as a clear loss). The slowest rank's numbers are agreed by one
all-reduce (MAX of the times), so every rank holds the same `LinkCosts`. The migration cost model reads its
link speed from here (unless `migration.inter_node_gbps` is set), and the numbers are logged and reported.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

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
    inter_node_bytes_per_s: float
    intra_node_bytes_per_s: float
    probe_bytes: int

    @property
    def inter_node_gbps(self) -> float:
        return self.inter_node_bytes_per_s * 8 / 1e9

    def to_dict(self) -> dict:
        return asdict(self)


def _timed_all_to_all(numel: int, group: dist.ProcessGroup | None, device: torch.device, repeats: int) -> float:
    peers = group_size(group)
    if group is None or peers == 1:
        return 0.0
    send = torch.zeros(numel * peers, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host sync (probe only)
        start = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
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
    stages = (groups.rail_group, groups.node_group)
    sizes = [probe_bytes, probe_bytes]
    fixed = _timed_all_to_all(8, groups.ep_group, device, repeats)
    fixed, *times = slowest_rank([fixed] + [_timed_all_to_all(n, g, device, repeats) for n, g in zip(sizes, stages)],
                                 groups.ep_group).tolist()  # NOTE: host sync (probe only)
    while True:  # every rank decides on the same agreed times, so all run the same calls
        grow = [i for i, (t, n) in enumerate(zip(times, sizes))
                if t > 0 and t - fixed < TRANSFER_OVER_FIXED * fixed and n < max_bytes]
        if not grow:
            break
        for i in grow:
            sizes[i] *= 4
            times[i] = _timed_all_to_all(sizes[i], stages[i], device, repeats)
        times = slowest_rank(times, groups.ep_group).tolist()

    def rate(seconds: float, numel: int, group: dist.ProcessGroup | None) -> float:
        peers = group_size(group) - 1
        if peers <= 0 or seconds <= 0:
            return float("inf")
        return numel * peers / max(seconds - fixed, seconds * 0.05)

    costs = LinkCosts(fixed_s=fixed, inter_node_bytes_per_s=rate(times[0], sizes[0], stages[0]),
                      intra_node_bytes_per_s=rate(times[1], sizes[1], stages[1]), probe_bytes=sizes[0])
    _CACHE[key] = costs
    return costs
