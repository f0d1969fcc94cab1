"""Collectives and host syncs per MoE layer forward and backward, per schedule, next to DeepSpeed's layer.

Counted with `ds_cobalt.runtime.call_counts` on 4 CPU ranks (2 nodes x 2). The numbers pin today's schedules:
a change that adds a collective or a host sync fails here (fixed cost per call dominates small messages).
"""

from __future__ import annotations

import copy

D, E = 16, 8


def _count_body(rank: int, world: int) -> dict:
    import torch
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import ds_cobalt
    from ds_cobalt.config import parse_cobalt_config
    from ds_cobalt.runtime.call_counts import count_collectives, count_host_syncs

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D, 24), torch.nn.GELU(), torch.nn.Linear(24, D))
    layers = {"deepspeed": DeepSpeedMoE(D, copy.deepcopy(expert), E, ep_size=world, k=2, drop_tokens=False,
                                        min_capacity=0)}
    for schedule in ("hierarchical", "direct", "dense"):
        for replicas in (False, True):
            cfg = parse_cobalt_config({"topology": {"ranks_per_node": 2}, "transport": {"schedule": schedule}})
            layers[f"{schedule}{'_replicas' if replicas else ''}"] = ds_cobalt.MoE(
                D, copy.deepcopy(expert), E, ep_size=world, k=2, cobalt_config=cfg)
    out = {}
    for name, layer in layers.items():
        layer.set_deepspeed_parallelism()
        if name.endswith("_replicas"):
            layer.set_layout(torch.cat([torch.as_tensor(layer.layout_slots),
                                        torch.tensor([[3], [0], [5], [6]])], 1).numpy())
        x = torch.randn(12 + rank, D, requires_grad=True)
        for _ in range(2):  # the second forward is counted (nothing is set up lazily in it)
            with count_collectives() as fwd, count_host_syncs() as fwd_syncs:
                y, aux, _ = layer(x)
            with count_collectives() as bwd, count_host_syncs() as bwd_syncs:
                (y.square().sum() + aux).backward()
        out[name] = {"collectives": (sum(fwd.values()), sum(bwd.values())),
                     "syncs": (sum(fwd_syncs.values()), sum(bwd_syncs.values())),
                     "where": dict(fwd_syncs + bwd_syncs)}
    return out


def test_collectives_and_syncs_per_layer(run_ranks) -> None:
    results = run_ranks(_count_body, 4, ranks_per_node=2, timeout=300)
    calls = {name: res["collectives"] for name, res in results[0].items()}
    assert all({n: r["collectives"] for n, r in res.items()} == calls for res in results)  # same calls everywhere
    # DeepSpeed's dropless layer: capacity all-reduce + dispatch and combine all-to-alls; backward mirrors.
    assert calls["deepspeed"] == (3, 2)
    # ds_cobalt.MoE calls DeepSpeed's gate without its dropless capacity all-reduce (top-2 routes do not depend
    # on it); hierarchical: one count exchange for both stages, rail rows + routes in one message, node rows,
    # node back, rail back; backward mirrors the four data messages
    assert calls["hierarchical"] == (5, 4)
    # direct: counts, rows + routes, rows back over the EP group: DeepSpeed's count
    assert calls["direct"] == (3, 2) == calls["deepspeed"]
    # dense: the capacity all-reduce (the gate's, moved), dispatch and combine: DeepSpeed's calls
    assert calls["dense"] == (3, 2) == calls["deepspeed"]
    # replicas add one weight fetch each way; dense leaves replica slots unused (no fetch)
    assert calls["hierarchical_replicas"] == (6, 5) and calls["direct_replicas"] == (4, 3)
    assert calls["dense_replicas"] == (3, 2)
    # one host sync per forward (the exchanged sizes or the capacity), none in backward, whatever the schedule
    for name in ("hierarchical", "direct", "dense", "hierarchical_replicas", "direct_replicas", "dense_replicas"):
        assert results[0][name]["syncs"] == (1, 0), (name, results[0][name]["where"])
