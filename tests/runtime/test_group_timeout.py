"""ds_cobalt's own process groups fail after `cobalt.topology.group_timeout_s` when a peer does not answer."""

from __future__ import annotations


def _body(rank: int, world: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from ds_cobalt.runtime.topology import build_ep_groups

    groups = build_ep_groups(None, 2, timeout_s=2.0)
    out = {"ep_is_own_group": groups.ep_group is not None and groups.ep_group is not dist.group.WORLD,
           "world_is_own_group": groups.world_group is not None and groups.world_group is not dist.group.WORLD}
    dist.barrier()
    if rank == 1:  # a peer that stops answering (stuck, or its node gone without closing connections)
        time.sleep(12)
        return out
    start = time.monotonic()
    try:
        # rank 2: ds_cobalt's copy of the world group (re-plans, migrations' agreement, traces, checkpoint state)
        group = {0: groups.node_group, 2: groups.world_group}.get(rank, groups.rail_group)
        dist.all_reduce(torch.ones(1), group=group)
        out["error"] = None
    except RuntimeError as err:
        out["error"] = str(err)[:200]
    out["waited_s"] = time.monotonic() - start
    return out


def test_a_silent_peer_is_an_error_after_the_group_timeout(run_ranks) -> None:
    results = run_ranks(_body, 4, ranks_per_node=2, timeout=120)
    assert all(r["ep_is_own_group"] and r["world_is_own_group"] for r in results)
    for rank in (0, 2, 3):  # rank 0 waits for rank 1 in its node group, rank 2 in the world, rank 3 on its rail
        assert results[rank]["error"] is not None, results[rank]
        assert results[rank]["waited_s"] < 10, results[rank]
