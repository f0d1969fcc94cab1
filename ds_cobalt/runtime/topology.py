"""Node topology of an expert-parallel (EP) group and its two communication groups.

An EP group of W = N * G ranks spans N nodes with G ranks each. The inter-node stage talks on the
*rail* group (the ranks with the same local index on every node); the intra-node stage on the node
group. Groups are created once, on every rank in the same order, and passed explicitly to the
dispatcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

# the deepspeed launcher's LOCAL_SIZE first: under it, accelerate (the HF Trainer) on CPU writes LOCAL_WORLD_SIZE=1,
# its default where none of the variables it reads is set (torchrun sets LOCAL_WORLD_SIZE and no LOCAL_SIZE)
_LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                    "SLURM_NTASKS_PER_NODE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


@dataclass(frozen=True)
class Topology:
    """Position of one rank inside its EP group (EP-group ranks, not global ranks)."""

    world_size: int  # W, ranks in the EP group
    ranks_per_node: int  # G, EP-group ranks per node
    rank: int  # this rank's index in the EP group

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"expert-parallel world size {self.world_size} is not divisible by "
                f"ranks_per_node={self.ranks_per_node} (set cobalt.topology.ranks_per_node)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node


@dataclass(frozen=True)
class EPGroups:
    """The process groups of one EP group. `ep_ranks[i]` is the global rank of EP rank i."""

    topology: Topology
    ep_ranks: tuple[int, ...]
    ep_group: dist.ProcessGroup | None
    rail_group: dist.ProcessGroup | None  # ranks with this local index on every node, in node order
    node_group: dist.ProcessGroup | None  # ranks of this node, in local order
    # every rank of the job, with ds_cobalt's timeout: its job-wide collectives (re-plans, migrations' agreement,
    # traces, checkpoint state) fail after `cobalt.topology.group_timeout_s` too (None: the default group)
    world_group: dist.ProcessGroup | None = None


def detect_ranks_per_node(world_size: int, override: int | None = None,
                          env: Mapping[str, str] | None = None, rank: int | None = None) -> int:
    """Ranks per node: the config override, else the launcher's local world size, else all ranks.

    Without the override, `rank` (global) is checked against the launcher's local rank: nodes must hold
    consecutive ranks (as `deepspeed`, `torchrun` and `mpirun --map-by slot` place them).
    """
    env = os.environ if env is None else env
    if override is not None:
        value, source = override, "cobalt.topology.ranks_per_node"
    else:
        found = next(((name, env[name]) for name in _LOCAL_SIZE_VARS if env.get(name, "").isdigit()), None)
        if found is None:
            return world_size
        value, source = int(found[1]), found[0]
    if value < 1 or world_size % value != 0:
        raise ValueError(f"world size {world_size} is not divisible by {source}={value}")
    local = next((int(env[name]) for name in _LOCAL_RANK_VARS if env.get(name, "").isdigit()), None)
    if override is None and rank is not None and local is not None and local != rank % value:
        raise ValueError(
            f"rank {rank} has local rank {local}, but ds_cobalt groups nodes as blocks of {value} consecutive "
            f"ranks (expected local rank {rank % value}); launch with consecutive ranks per node "
            "(e.g. mpirun --map-by slot) or set cobalt.topology.ranks_per_node")
    return value


_GROUP_CACHE: dict[tuple, EPGroups] = {}
_WORLD_GROUPS: dict[float | None, dist.ProcessGroup | None] = {}  # by timeout


def build_ep_groups(ep_group: dist.ProcessGroup | None, ranks_per_node: int,
                    timeout_s: float | None = None) -> EPGroups:
    """Create (once per EP layout) the rail and node groups for every EP group, and a copy of the EP group for
    ds_cobalt's own collectives, and (once per timeout) a copy of the world group; return this rank's.
    `timeout_s`: their collectives' timeout (None: the default group's).

    `ranks_per_node` counts *global* ranks per node; nodes are blocks of consecutive global ranks,
    as the DeepSpeed launcher assigns them. Collective: every rank must call it in the same order.
    """
    world = dist.get_world_size()
    if world % ranks_per_node != 0:
        raise ValueError(f"world size {world} is not divisible by ranks_per_node={ranks_per_node}")
    my_ep_ranks = tuple(dist.get_process_group_ranks(ep_group)) if ep_group is not None else tuple(range(world))
    key = (my_ep_ranks, ranks_per_node, timeout_s)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key]

    all_ep: list[tuple[int, ...] | None] = [None] * world
    dist.all_gather_object(all_ep, my_ep_ranks)
    ep_groups = sorted(set(all_ep))  # identical order on every rank

    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if timeout_s not in _WORLD_GROUPS:  # (first, so every rank creates the groups in the same order)
        _WORLD_GROUPS[timeout_s] = dist.new_group(list(range(world)), timeout=timeout) if world > 1 else None
    mine: dict[str, dist.ProcessGroup | None] = {}
    topology = None
    for members in ep_groups:
        nodes = _split_by_node(members, ranks_per_node)
        per_node = len(nodes[0])
        rails = [tuple(node[j] for node in nodes) for j in range(per_node)]
        for name, rank_sets in (("ep", [members]), ("rail", rails), ("node", nodes)):
            for ranks in rank_sets:
                group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
                if dist.get_rank() in ranks and members == my_ep_ranks:
                    mine[name] = group
        if members == my_ep_ranks:
            topology = Topology(len(members), per_node, members.index(dist.get_rank()))
    assert topology is not None
    groups = EPGroups(topology, my_ep_ranks, mine.get("ep"), mine.get("rail"), mine.get("node"),
                      _WORLD_GROUPS[timeout_s])
    _GROUP_CACHE[key] = groups
    return groups


def _split_by_node(members: tuple[int, ...], ranks_per_node: int) -> list[tuple[int, ...]]:
    by_node: dict[int, list[int]] = {}
    for rank in sorted(members):
        by_node.setdefault(rank // ranks_per_node, []).append(rank)
    sizes = {len(ranks) for ranks in by_node.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"expert-parallel group {list(members)} has different rank counts per node {sorted(sizes)} "
            f"with ranks_per_node={ranks_per_node}; choose ep_size as a divisor or multiple of ranks_per_node"
        )
    # The EP-group rank order must be node-major for rank = node * G + local to hold.
    if [r for ranks in by_node.values() for r in ranks] != list(members):
        raise ValueError(f"expert-parallel group {list(members)} is not ordered node by node")
    return [tuple(ranks) for ranks in by_node.values()]
