"""The start-up link probe: every rank gets the same numbers, and stages without peers are free."""

from __future__ import annotations

import math


def _probe_body(rank: int, world: int, ranks_per_node: int) -> dict:
    import torch
    import torch.distributed as dist

    from ds_cobalt.runtime.link_probe import probe_links
    from ds_cobalt.runtime.topology import build_ep_groups

    groups = build_ep_groups(dist.new_group(list(range(world))), ranks_per_node)
    costs = probe_links(groups, torch.device("cpu"), probe_bytes=64 << 10, max_bytes=1 << 20)
    again = probe_links(groups, torch.device("cpu"), probe_bytes=64 << 10)  # cached: no collective
    return {**costs.to_dict(), "cached": again is costs}


def test_probe_agrees_across_ranks(run_ranks) -> None:
    results = run_ranks(_probe_body, 4, 2, ranks_per_node=2, timeout=120)
    assert all(r == results[0] for r in results)  # one all-reduce: the slowest rank's numbers everywhere
    r = results[0]
    assert r["cached"] and r["fixed_s"] > 0
    # the cross-node probe grew by 4x steps from 64 KiB (while its transfer was short against the fixed cost), to 1 MiB
    # at most; every rank ran the same calls (the growth follows the agreed times)
    assert r["probe_bytes"] in (64 << 10, 256 << 10, 1 << 20)
    assert 0 < r["inter_node_bytes_per_s"] < math.inf and 0 < r["intra_node_bytes_per_s"] < math.inf


def test_probe_one_node_has_no_cross_node_stage(run_ranks) -> None:
    results = run_ranks(_probe_body, 2, 2, ranks_per_node=2, timeout=120)
    assert all(r == results[0] for r in results)
    assert results[0]["inter_node_bytes_per_s"] == math.inf and results[0]["intra_node_bytes_per_s"] < math.inf


def test_probe_grows_until_the_transfer_dominates_the_fixed_cost(monkeypatch) -> None:
    """One process, timed calls replaced by a link model (1 ms per call, 125 MB/s per rank across nodes, 1 GB/s
    inside): a probe grows 4x while its transfer takes less than TRANSFER_OVER_FIXED times the fixed cost, up to
    `max_bytes`, and the rates come from the last sizes. The cross-node probe is one all-to-all over the EP group
    that sends to the other node's ranks only (`probe_bytes / G` to each), so the node's ranks share its link."""
    import types

    import pytest
    import torch

    from ds_cobalt.runtime import link_probe
    from ds_cobalt.runtime.topology import Topology

    calls = []

    def timed(numel, group, device, repeats, to_peer=None):
        calls.append((group, numel, None if to_peer is None else tuple(to_peer)))
        sent = numel * (sum(to_peer) if to_peer is not None else 1)
        return 1e-3 + (0.0 if numel == 8 else sent / (125e6 if group == "ep" else 1e9))

    monkeypatch.setattr(link_probe, "_timed_all_to_all", timed)
    monkeypatch.setattr(link_probe, "slowest_rank", lambda seconds, group: torch.tensor(list(seconds)))
    monkeypatch.setattr(link_probe, "_CACHE", {})
    groups = types.SimpleNamespace(ep_ranks=(0, 1, 2, 3), topology=Topology(4, 2, 1), ep_group="ep",
                                   rail_group="rail", node_group="node")
    costs = link_probe.probe_links(groups, torch.device("cpu"), probe_bytes=256 << 10, max_bytes=4 << 20)
    # across: 256 KiB per other node (128 KiB to each of its 2 ranks) takes 2.1 ms (< 4 x 1 ms), 1 MiB 8.4 ms;
    # node: 0.26, 1.05, then 4.2 ms at the 4 MiB cap
    assert [(n, to) for g, n, to in calls if g == "ep" and n != 8] == [(128 << 10, (False, False, True, True)),
                                                                       (512 << 10, (False, False, True, True))]
    assert [n for g, n, _ in calls if g == "node"] == [256 << 10, 1 << 20, 4 << 20]
    assert "rail" not in {g for g, _, _ in calls}
    assert costs.probe_bytes == 1 << 20 and costs.fixed_s == pytest.approx(1e-3)
    assert costs.inter_node_bytes_per_s == pytest.approx(125e6) and costs.intra_node_bytes_per_s == pytest.approx(1e9)
