"""The start-up link probe: every rank gets the same numbers, and stages without peers are free."""

from __future__ import annotations

import math


def _probe_body(rank: int, world: int, ranks_per_node: int) -> dict:
    import torch
    import torch.distributed as dist

    from ds_cobalt.runtime.link_probe import probe_links
    from ds_cobalt.runtime.topology import build_ep_groups

    groups = build_ep_groups(dist.new_group(list(range(world))), ranks_per_node)
    costs = probe_links(groups, torch.device("cpu"), probe_bytes=64 << 10)
    again = probe_links(groups, torch.device("cpu"), probe_bytes=64 << 10)  # cached: no collective
    return {**costs.to_dict(), "cached": again is costs}


def test_probe_agrees_across_ranks(run_ranks) -> None:
    results = run_ranks(_probe_body, 4, 2, ranks_per_node=2, timeout=120)
    assert all(r == results[0] for r in results)  # one all-reduce: the slowest rank's numbers everywhere
    r = results[0]
    assert r["cached"] and r["fixed_s"] > 0
    assert 0 < r["inter_node_bytes_per_s"] < math.inf and 0 < r["intra_node_bytes_per_s"] < math.inf


def test_probe_one_node_has_no_cross_node_stage(run_ranks) -> None:
    results = run_ranks(_probe_body, 2, 2, ranks_per_node=2, timeout=120)
    assert all(r == results[0] for r in results)
    assert results[0]["inter_node_bytes_per_s"] == math.inf and results[0]["intra_node_bytes_per_s"] < math.inf
